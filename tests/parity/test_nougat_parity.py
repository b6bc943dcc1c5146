"""Greedy ids and log-probs of mmserve vs transformers on a tiny random Nougat checkpoint (Donut Swin encoder,
MBart decoder with cross-attention): the decoder prompt is its start token (plus any text that begins the answer),
the picture reaches it through every layer's cross-attention.

Covers a page alone and with a forced beginning, a staggered batch of different pages, prefix / prompt-end cache
hits by picture (and none for another picture), preemption, and prompts without a picture refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.nougat import make_nougat_checkpoint
from tests.parity.hf_oracle import TOL, assert_matches_oracle, run_staggered

N = 16
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def nougat_dir(tmp_path_factory) -> str:
    return str(
        make_nougat_checkpoint(tmp_path_factory.mktemp("tiny_nougat"), preset="tiny", seed=0)
    )


@functools.lru_cache(maxsize=2)
def _hf(model_dir: str):
    model = transformers.VisionEncoderDecoderModel.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    return model, transformers.AutoProcessor.from_pretrained(model_dir)


def _oracle(model_dir: str, prompt: dict, device: str = "cpu"):
    """The model on the CPU; the page resized where mmserve resizes it (on the GPU when it runs there)."""
    model, processor = _hf(model_dir)
    kw = {"device": device} if device != "cpu" else {}
    pixels = processor(images=prompt["images"], return_tensors="pt", **kw).pixel_values.cpu()
    start = model.config.decoder_start_token_id
    ids = [start] + (
        processor.tokenizer(prompt["prompt"], add_special_tokens=False).input_ids
        if prompt["prompt"]
        else []
    )
    with torch.no_grad():
        # forced_eos_token_id (MBart's generation config) forces EOS at the length limit; mmserve, like
        # TensorRT-LLM, stops there without rewriting the last token
        out = model.generate(
            pixel_values=pixels,
            decoder_input_ids=torch.tensor([ids]),
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            forced_eos_token_id=None,
        )
    return (
        ids,
        out.sequences[0, len(ids) :].tolist(),
        torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1),
    )


def _page(i: int, text: str = "") -> dict:
    return {"prompt": text, "images": [make_test_image(i, (60 + 7 * i, 80))]}


@pytest.mark.parametrize("text", ["", "# Intro"])
def test_page_matches_transformers(nougat_dir, text):
    llm = LLM(nougat_dir, device="cpu", dtype="float32")
    prompt = _page(1, text)
    out = llm.generate([prompt], GREEDY)[0]
    assert_matches_oracle(out, _oracle(nougat_dir, prompt))
    other = llm.generate([_page(2, text)], GREEDY)[0]
    assert other.outputs[0].token_ids != out.outputs[0].token_ids  # the page conditions the answer


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_of_pages(nougat_dir, device):
    llm = LLM(nougat_dir, device=device, dtype="float32", enable_prefix_caching=False)
    prompts = [_page(i, "# A" if i % 2 else "") for i in range(5)]
    for prompt, out in zip(prompts, run_staggered(llm.engine, prompts, GREEDY)):
        assert_matches_oracle(out, _oracle(nougat_dir, prompt, device), TOL[device])
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_same_page_hits_the_caches_other_page_does_not(nougat_dir):
    llm = LLM(nougat_dir, device="cpu", dtype="float32", block_size=4)
    text = "# Title of the page and more words"
    first = llm.generate([_page(3, text)], GREEDY)[0]
    again = llm.generate([_page(3, text)], GREEDY)[0]  # the same picture as a new object
    assert first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens >= 4
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate([_page(4, text)], GREEDY)[0]
    assert other.metrics.num_cached_tokens == 0
    assert_matches_oracle(other, _oracle(nougat_dir, _page(4, text)))


def test_preemption_and_missing_picture(nougat_dir):
    tight = LLM(
        nougat_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=12,
        enable_prefix_caching=False,
        cross_kv_cache_fraction=0.9,
    )  # a fixed pool: the cross pool gets 0.9 / 0.1 of its bytes
    prompts = [_page(10 + i) for i in range(4)]
    for prompt, out in zip(prompts, tight.generate(prompts, GREEDY)):
        assert_matches_oracle(out, _oracle(nougat_dir, prompt))
    with pytest.raises(ValueError, match="images: this model reads one picture"):
        tight.generate([{"prompt": "no page"}], GREEDY)
    assert not tight.engine.scheduler.waiting and not tight.engine.scheduler.running


def test_triton_ensemble_reads_a_page(nougat_dir, tmp_path):
    """The Triton way to ask for a page's markdown: an image and an empty `text_input` on a real server."""
    import httpx

    from mmserve.testing import image_to_data_uri
    from tests.server.conftest import start_server

    page = _page(6)
    body = {
        "text_input": "",
        "max_tokens": N,
        "min_tokens": N,
        "temperature": 0,
        "image_url_input": image_to_data_uri(page["images"][0]),
    }
    with start_server(nougat_dir, tmp_path) as server:
        r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
        missing = httpx.post(
            f"{server.http_url}/v2/models/ensemble/generate",
            json={"text_input": "", "max_tokens": 4},
            timeout=60,
        )
    assert r.status_code == 200, r.text
    _, want_ids, _ = _oracle(nougat_dir, page)
    processor = _hf(nougat_dir)[1]
    assert r.json()["text_output"] == processor.tokenizer.decode(want_ids, skip_special_tokens=True)
    assert missing.status_code == 400 and "images: this model reads one picture" in missing.text
