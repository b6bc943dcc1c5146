"""Greedy ids and log-probs of mmserve vs transformers on a tiny random Fuyu checkpoint (Persimmon decoder:
fused per-head q/k/v, q/k LayerNorms, partial rotary, squared-ReLU MLP; linear patch embeddings).

Covers one picture of several sizes (rows of patches as items), text-only prompts, a staggered batch mixing
them, prefix-cache hits by picture, chunked prefill cutting through the rows, and more than one picture refused.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.fuyu import make_fuyu_checkpoint
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 24
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SIZES = [(48, 40), (200, 100), (30, 90)]  # 2x2, 2x3 and 3x1 patches


@pytest.fixture(scope="module")
def fuyu_dir(tmp_path_factory) -> str:
    return str(make_fuyu_checkpoint(tmp_path_factory.mktemp("tiny_fuyu"), preset="tiny", seed=0))


def _prompt(i: int, with_image: bool = True) -> dict:
    text = (
        "Generate a coco-style caption.\n"
        if i == 0
        else f"What is number {i} here?" + " Tell me." * (i % 3)
    )
    return {"prompt": text, "images": [make_test_image(10 * i, SIZES[i % 3])] if with_image else []}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("i", [0, 1, 2])
def test_picture_of_each_size_matches_transformers(fuyu_dir, device, i):
    llm = LLM(fuyu_dir, device=device, dtype="float32")
    prompt = _prompt(i)
    out = llm.generate([prompt], GREEDY)[0]
    image_id = llm.engine.hf_config.image_token_id
    assert out.prompt_token_ids.count(image_id) == sum(
        len(it.data["patches"]) for it in llm.engine.inputs.process(prompt).mm_items
    )
    check_against_hf(fuyu_dir, prompt, out, N, device)


def test_text_only_prompt_matches_transformers(fuyu_dir):
    llm = LLM(fuyu_dir, device="cpu", dtype="float32")
    prompt = _prompt(4, with_image=False)
    check_against_hf(fuyu_dir, prompt, llm.generate([prompt], GREEDY)[0], N)


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_of_picture_and_text_requests(fuyu_dir, device):
    llm = LLM(fuyu_dir, device=device, dtype="float32", enable_prefix_caching=False)
    prompts = [_prompt(i, with_image=i % 3 != 1) for i in range(6)]
    for prompt, out in zip(prompts, run_staggered(llm.engine, prompts, GREEDY)):
        check_against_hf(fuyu_dir, prompt, out, N, device)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_same_picture_hits_the_prefix_cache_and_chunks_cut_rows(fuyu_dir):
    llm = LLM(fuyu_dir, device="cpu", dtype="float32", block_size=4)
    first = llm.generate([_prompt(1)], GREEDY)[0]
    again = {
        "prompt": _prompt(1)["prompt"],
        "images": [make_test_image(10, SIZES[1])],
    }  # same picture, new object
    second = llm.generate([again], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0 and second.metrics.num_cached_tokens >= 8
    check_against_hf(fuyu_dir, again, second, N)
    chunked = LLM(
        fuyu_dir,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=3,
        enable_prefix_caching=False,
    )
    check_against_hf(fuyu_dir, _prompt(2), chunked.generate([_prompt(2)], GREEDY)[0], N)


def test_two_pictures_are_refused(fuyu_dir):
    llm = LLM(fuyu_dir, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="at most one image"):
        llm.generate(
            [{"prompt": "two", "images": [make_test_image(1), make_test_image(2)]}], GREEDY
        )
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
