"""Greedy ids and log-probs of mmserve vs transformers on a tiny random Kosmos-2 checkpoint (CLIP tower, latent
queries over its normalised states, a decoder with sub-LayerNorms, scaled embeddings and sinusoidal positions).

Covers a grounding prompt with an image, text-only prompts, a staggered batch mixing them, prefix-cache hits
by picture, chunked prefill cutting through the image span, and more than one picture refused.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.kosmos2 import make_kosmos2_checkpoint
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 24
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def kosmos2_dir(tmp_path_factory) -> str:
    return str(
        make_kosmos2_checkpoint(tmp_path_factory.mktemp("tiny_kosmos2"), preset="tiny", seed=0)
    )


def _prompt(i: int, with_image: bool = True) -> dict:
    text = (
        "<grounding>An image of"
        if i == 0
        else f"Question {i}: what is here?" + " Say it." * (i % 3)
    )
    return {"prompt": text, "images": [make_test_image(10 * i)] if with_image else []}


@pytest.mark.parametrize("device", DEVICES)
def test_grounding_prompt_with_an_image_matches_transformers(kosmos2_dir, device):
    llm = LLM(kosmos2_dir, device=device, dtype="float32")
    prompt = _prompt(0)
    out = llm.generate([prompt], GREEDY)[0]
    check_against_hf(kosmos2_dir, prompt, out, N, device)
    other = llm.generate([{"prompt": prompt["prompt"], "images": [make_test_image(77)]}], GREEDY)[0]
    assert (
        other.outputs[0].token_ids != out.outputs[0].token_ids
    )  # the picture conditions the answer


def test_text_only_prompt_matches_transformers(kosmos2_dir):
    llm = LLM(kosmos2_dir, device="cpu", dtype="float32")
    prompt = _prompt(4, with_image=False)
    check_against_hf(kosmos2_dir, prompt, llm.generate([prompt], GREEDY)[0], N)


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_of_picture_and_text_requests(kosmos2_dir, device):
    llm = LLM(kosmos2_dir, device=device, dtype="float32", enable_prefix_caching=False)
    prompts = [_prompt(i, with_image=i % 3 != 1) for i in range(6)]
    for prompt, out in zip(prompts, run_staggered(llm.engine, prompts, GREEDY)):
        check_against_hf(kosmos2_dir, prompt, out, N, device)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_same_picture_hits_the_prefix_cache_and_chunks_cut_the_span(kosmos2_dir):
    llm = LLM(kosmos2_dir, device="cpu", dtype="float32", block_size=4)
    first = llm.generate([_prompt(2)], GREEDY)[0]
    again = {
        "prompt": _prompt(2)["prompt"],
        "images": [make_test_image(20)],
    }  # same picture, new object
    second = llm.generate([again], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0 and second.metrics.num_cached_tokens >= 8
    check_against_hf(kosmos2_dir, again, second, N)
    chunked = LLM(
        kosmos2_dir,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=3,
        enable_prefix_caching=False,
    )
    check_against_hf(kosmos2_dir, _prompt(3), chunked.generate([_prompt(3)], GREEDY)[0], N)


def test_two_pictures_are_refused(kosmos2_dir):
    llm = LLM(kosmos2_dir, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="at most one image"):
        llm.generate(
            [{"prompt": "two", "images": [make_test_image(1), make_test_image(2)]}], GREEDY
        )
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
