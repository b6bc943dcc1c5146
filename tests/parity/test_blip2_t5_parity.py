"""Greedy ids and log-probs of mmserve vs transformers on a tiny random BLIP-2 with Flan-T5 (encoder-decoder T5:
unscaled attention with relative-position buckets, gated-GELU, RMS norms): the query tokens and the question go
through the T5 encoder, the decoder answers from its start token over the paged cache.

Covers one question, a staggered batch (different pictures and questions; the same picture with two questions
gets two encodings), prompt-end / prefix hits of exact repeats, preemption, and a prompt without a picture refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.blip2 import make_blip2_checkpoint
from tests.parity.hf_oracle import TOL, assert_matches_oracle, run_staggered

N = 16
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory) -> str:
    return str(
        make_blip2_checkpoint(tmp_path_factory.mktemp("tiny_blip2_t5"), preset="tiny-t5", seed=0)
    )


@functools.lru_cache(maxsize=2)
def _hf(model_dir: str):
    model = transformers.Blip2ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    return model, transformers.AutoProcessor.from_pretrained(model_dir)


def _oracle(model_dir: str, prompt: dict, device: str = "cpu"):
    """The model on the CPU; the picture resized where mmserve resizes it (on the GPU when it runs there). A
    prompt's decoder_prompt becomes the decoder's input after its start token."""
    model, processor = _hf(model_dir)
    kw = {"device": device} if device != "cpu" else {}
    enc = processor(images=prompt["images"], text=prompt["prompt"], return_tensors="pt", **kw).to(
        "cpu"
    )
    start = model.config.text_config.decoder_start_token_id
    decoder = [start] + processor.tokenizer(
        prompt.get("decoder_prompt", ""), add_special_tokens=False
    ).input_ids
    with torch.no_grad():
        out = model.generate(
            **enc,
            decoder_input_ids=torch.tensor([decoder]),
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    seq = out.sequences[0].tolist()
    assert seq[: len(decoder)] == decoder
    return (
        decoder,
        seq[len(decoder) :],
        torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1),
    )


def _prompt(i: int, question: str = "Question: what is shown here? Answer:") -> dict:
    return {"prompt": question, "images": [make_test_image(i)]}


def test_decoder_prompt_starts_the_answer_as_in_transformers(t5_dir):
    """Triton's decoder_text_input: the question stays the encoder's, the decoder starts from its start token
    and these tokens."""
    llm = LLM(t5_dir, device="cpu", dtype="float32")
    prompt = {**_prompt(2), "decoder_prompt": "the answer is"}
    out = llm.generate([prompt], GREEDY)[0]
    assert len(out.prompt_token_ids) > 1
    assert_matches_oracle(out, _oracle(t5_dir, prompt))


def test_question_matches_transformers(t5_dir):
    llm = LLM(t5_dir, device="cpu", dtype="float32")
    out = llm.generate([_prompt(1)], GREEDY)[0]
    assert_matches_oracle(out, _oracle(t5_dir, _prompt(1)))
    other = llm.generate([_prompt(1, "Question: how many? Answer:")], GREEDY)[
        0
    ]  # the text is the encoder's
    assert_matches_oracle(other, _oracle(t5_dir, _prompt(1, "Question: how many? Answer:")))
    assert other.outputs[0].token_ids != out.outputs[0].token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_and_repeats(t5_dir, device):
    llm = LLM(t5_dir, device=device, dtype="float32", block_size=4)
    prompts = [_prompt(i % 3, f"Question: item {i}? Answer:") for i in range(5)]
    for prompt, out in zip(prompts, run_staggered(llm.engine, prompts, GREEDY)):
        assert_matches_oracle(out, _oracle(t5_dir, prompt, device), TOL[device])
    again = llm.generate([prompts[0]], GREEDY)[
        0
    ]  # an exact repeat: its first token from the prompt-end cache
    assert again.outputs[0].token_ids == _oracle(t5_dir, prompts[0])[1]
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_preemption_and_missing_picture(t5_dir):
    tight = LLM(
        t5_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=10,
        enable_prefix_caching=False,
        cross_kv_cache_fraction=0.9,
    )  # a fixed pool: the cross pool gets 0.9 / 0.1 of its bytes
    prompts = [_prompt(10 + i) for i in range(4)]
    for prompt, out in zip(prompts, tight.generate(prompts, GREEDY)):
        assert_matches_oracle(out, _oracle(t5_dir, prompt))
    with pytest.raises(ValueError, match="images: this model reads one picture"):
        tight.generate([{"prompt": "Question: no picture? Answer:"}], GREEDY)


def test_triton_ensemble_answers_as_transformers(t5_dir, tmp_path):
    """The seeds' BLIP-2 request (question in `text_input`, the picture as a URL) on a real server."""
    import httpx

    from mmserve.testing import image_to_data_uri
    from tests.server.conftest import start_server

    prompt = _prompt(7, "Question: which city is this? Answer:")
    body = {
        "text_input": prompt["prompt"],
        "max_tokens": N,
        "min_tokens": N,
        "temperature": 0,
        "image_url_input": image_to_data_uri(prompt["images"][0]),
        "exclude_input_in_output": True,
    }
    with start_server(t5_dir, tmp_path) as server:
        r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    _, want, _ = _oracle(t5_dir, prompt)
    assert r.json()["text_output"] == _hf(t5_dir)[1].tokenizer.decode(
        want, skip_special_tokens=True
    )
