"""Greedy ids and log-probs of mmserve vs transformers on a tiny random Pix2Struct / Deplot checkpoint (a VQA
model: the question is drawn above the picture, a ViT over its variable-resolution patches, a T5-style decoder with
cross-attention that starts from its start token alone).

The oracle's inputs come from `vqa_inputs` (the image processor's own header rendering in Pillow's built-in font,
which the unit tests check equal to the stock processor call given that font in the hub cache); mmserve picks the
same font when neither the checkpoint nor the hub cache has Arial. Covers a question alone, a staggered batch of
pictures and questions, caches by picture and question, preemption, a missing picture, the header font option,
and a Triton ensemble request on a real server.
"""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.testing import make_test_image
from mmserve.testing.pix2struct import DEPLOT_PROMPT, make_pix2struct_checkpoint, vqa_inputs
from tests.parity.hf_oracle import TOL, _load, assert_matches_oracle, run_staggered

N = 16
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def deplot_dir(tmp_path_factory) -> str:
    return str(
        make_pix2struct_checkpoint(
            tmp_path_factory.mktemp("tiny_deplot"), preset="tiny", seed=0, progress=False
        )
    )


def _oracle(model_dir: str, prompt: dict):
    model, processor = _load(model_dir, "cpu")
    enc = vqa_inputs(processor, prompt["images"], prompt["prompt"])
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    start = model.config.decoder_start_token_id
    seq = out.sequences[0].tolist()
    assert seq[0] == start
    return [start], seq[1:], torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1)


def _chart(i: int, question: str = DEPLOT_PROMPT) -> dict:
    return {"prompt": question, "images": [make_test_image(i, (50 + 9 * i, 40 + 5 * (i % 3)))]}


def test_chart_question_matches_transformers(deplot_dir):
    llm = LLM(deplot_dir, device="cpu", dtype="float32")
    prompt = _chart(1)
    out = llm.generate([prompt], GREEDY)[0]
    assert_matches_oracle(out, _oracle(deplot_dir, prompt))
    other = llm.generate([_chart(1, "What is the highest value?")], GREEDY)[
        0
    ]  # the question is in the pixels
    assert_matches_oracle(other, _oracle(deplot_dir, _chart(1, "What is the highest value?")))
    assert other.outputs[0].token_ids != out.outputs[0].token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_of_charts_and_questions(deplot_dir, device):
    llm = LLM(deplot_dir, device=device, dtype="float32", enable_prefix_caching=False)
    prompts = [
        _chart(i, DEPLOT_PROMPT if i % 2 else f"Question {i}: what is the trend?") for i in range(5)
    ]
    for prompt, out in zip(prompts, run_staggered(llm.engine, prompts, GREEDY)):
        assert_matches_oracle(out, _oracle(deplot_dir, prompt), TOL[device])
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_caches_key_on_the_picture_and_the_question(deplot_dir):
    llm = LLM(deplot_dir, device="cpu", dtype="float32", block_size=4)
    first = llm.generate([_chart(3)], GREEDY)[0]
    again = llm.generate([_chart(3)], GREEDY)[0]  # the same picture (a new object) and question
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(llm.engine.runner.encoder.cache) == 1
    asked = llm.generate([_chart(3, "Which year?")], GREEDY)[
        0
    ]  # same picture, another header: encoded anew
    assert len(llm.engine.runner.encoder.cache) == 2 and asked.metrics.num_cached_tokens == 0
    assert_matches_oracle(asked, _oracle(deplot_dir, _chart(3, "Which year?")))


def test_preemption_missing_picture_and_preprocessed_pixels(deplot_dir):
    tight = LLM(
        deplot_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=10,
        enable_prefix_caching=False,
        cross_kv_cache_fraction=0.9,
    )  # a fixed pool: the cross pool gets 0.9 / 0.1 of its bytes
    prompts = [_chart(10 + i) for i in range(4)]
    for prompt, out in zip(prompts, tight.generate(prompts, GREEDY)):
        assert_matches_oracle(out, _oracle(deplot_dir, prompt))
    with pytest.raises(ValueError, match="images: this model reads one picture"):
        tight.generate([{"prompt": "no chart"}], GREEDY)
    with pytest.raises(
        ValueError, match="pixel_values: this model does not take preprocessed pixels"
    ):
        tight.generate(
            [{"prompt": DEPLOT_PROMPT, "pixel_values": torch.zeros(1, 3, 16, 16)}], GREEDY
        )
    assert not tight.engine.scheduler.waiting and not tight.engine.scheduler.running


def test_header_font_option(deplot_dir, tmp_path):
    """A given font draws the header (other pixels, so another answer); a missing one is refused up front."""
    from mmserve.models.pix2struct import builtin_font_bytes

    font = tmp_path / "font.ttf"
    font.write_bytes(builtin_font_bytes())
    llm = LLM(
        deplot_dir, device="cpu", dtype="float32", media=MediaConfig(header_font_path=str(font))
    )
    got = llm.engine.inputs.process(_chart(2)).mm_items[0].data["flattened_patches"]
    want = vqa_inputs(_load(deplot_dir, "cpu")[1], _chart(2)["images"], DEPLOT_PROMPT)
    assert torch.equal(got, want["flattened_patches"][0][want["attention_mask"][0].bool()])
    with pytest.raises(ValueError, match="header_font_path"):
        MediaConfig(header_font_path=str(tmp_path / "missing.ttf"))


def test_triton_ensemble_and_openai_chat_answer_a_chart_question(deplot_dir, tmp_path):
    """The seed's Deplot request through Triton (the question as `text_input`, a chart) and the same question as an
    OpenAI chat message on one real server; a chat of two turns is refused naming the field."""
    import httpx
    import openai

    from mmserve.testing import image_to_data_uri
    from tests.server.conftest import start_server

    chart = _chart(6)
    url = image_to_data_uri(chart["images"][0])
    body = {
        "text_input": DEPLOT_PROMPT,
        "max_tokens": N,
        "min_tokens": N,
        "temperature": 0,
        "image_url_input": url,
    }
    user = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": DEPLOT_PROMPT},
        ],
    }
    with start_server(deplot_dir, tmp_path) as server:
        r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
        missing = httpx.post(
            f"{server.http_url}/v2/models/ensemble/generate",
            json={"text_input": DEPLOT_PROMPT, "max_tokens": 4},
            timeout=60,
        )
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
        chat = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[user],
            max_tokens=N,
            temperature=0,
            extra_body={"min_tokens": N},
        )
        with pytest.raises(
            openai.BadRequestError, match="messages: this model takes one user message"
        ):
            client.chat.completions.create(
                model=client.models.list().data[0].id,
                max_tokens=4,
                messages=[user, {"role": "assistant", "content": "x"}, user],
            )
    assert r.status_code == 200, r.text
    _, want_ids, _ = _oracle(deplot_dir, chart)
    want = _load(deplot_dir, "cpu")[1].tokenizer.decode(want_ids, skip_special_tokens=True)
    assert r.json()["text_output"] == want and chat.choices[0].message.content == want
    assert missing.status_code == 400 and "images: this model reads one picture" in missing.text
