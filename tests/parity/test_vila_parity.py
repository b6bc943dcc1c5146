"""Greedy ids and log-probs of mmserve vs the eager VILA reference (tests/parity/vila_reference.py) on tiny random
VILA 1.5 checkpoints in the published layout (llm/, vision_tower/, mm_projector/ sub-folders).

Covers one prompt with two interleaved pictures, a text-only prompt, the "pad" aspect rule, continuous batching
with arrivals at different steps, prefix-cache hit and miss by picture, chunked prefill cutting a picture's span,
preemption, pixel_values sent preprocessed, and tensor parallelism (two CPU shards).
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.models.vila import PLACEHOLDER_ID
from mmserve.testing import make_test_image
from mmserve.testing.vila import make_vila_checkpoint
from tests.parity.hf_oracle import assert_matches_oracle, assert_two_shards_match_one, run_staggered
from tests.parity.vila_reference import process_image, reference_greedy

N = 32
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {"cpu": 2e-3, "cuda": 1e-2}


@pytest.fixture(scope="module")
def vila_dir(tmp_path_factory) -> str:
    return str(make_vila_checkpoint(tmp_path_factory.mktemp("vila")))


def _prompt(i: int, num_images: int) -> dict:
    tags = "".join("<image>\n" for _ in range(num_images))
    words = " ".join(["tell me about it"] * (i % 3 + 1))
    return {
        "prompt": f"A chat. USER: {tags}{words} number {i}? ASSISTANT:",
        "images": [make_test_image(10 * i + k, (40 + 8 * k, 36)) for k in range(num_images)],
    }


def _check(model_dir: str, prompt: dict, out, device: str) -> None:
    oracle = reference_greedy(model_dir, prompt["prompt"], prompt.get("images"), N, device)
    assert_matches_oracle(out, oracle, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_two_pictures_and_text_only_match_the_reference(vila_dir, device):
    llm = LLM(vila_dir, device=device, dtype="float32")
    for prompt in (_prompt(0, 2), _prompt(1, 0), _prompt(2, 1)):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.prompt_token_ids.count(PLACEHOLDER_ID) == 4 * len(prompt["images"])
        _check(vila_dir, prompt, out, device)


def test_pad_aspect_rule_matches_the_reference(tmp_path):
    model_dir = str(make_vila_checkpoint(tmp_path / "pad", preset="tiny-pad", seed=1))
    llm = LLM(model_dir, device="cpu", dtype="float32")
    prompt = _prompt(3, 2)  # pictures that are not square: padded with the mean colour
    _check(model_dir, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_prefix_hits_and_chunks_match(vila_dir, device):
    llm = LLM(vila_dir, device=device, dtype="float32", block_size=4, max_num_batched_tokens=6)
    engine = llm.engine
    prompts = [_prompt(i, i % 3) for i in range(6)]
    outs = run_staggered(engine, prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        _check(vila_dir, prompt, out, device)
    # the same pictures (fresh objects) behind the same text hit the cache; another picture does not past it
    again = {"prompt": prompts[1]["prompt"], "images": [make_test_image(10, (40, 36))]}
    hit = llm.generate([again], GREEDY, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= 12
    _check(vila_dir, again, hit, device)
    other = {"prompt": prompts[1]["prompt"], "images": [make_test_image(77, (40, 36))]}
    miss = llm.generate([other], GREEDY, use_tqdm=False)[0]
    assert miss.metrics.num_cached_tokens <= miss.prompt_token_ids.index(PLACEHOLDER_ID)
    _check(vila_dir, other, miss, device)
    assert not engine.scheduler.running and engine.kv.pool.num_free == engine.kv.num_blocks


def test_chunk_boundaries_inside_a_picture_and_preemption_match(vila_dir):
    llm = LLM(
        vila_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=36,
        max_num_batched_tokens=3,
        enable_prefix_caching=False,
    )
    prompts = [_prompt(i, 2) for i in range(4)]
    ids = llm.engine.inputs.process(prompts[0]).prompt_token_ids
    at = [i for i, t in enumerate(ids) if t == PLACEHOLDER_ID]
    assert any(p % 3 == 0 and p - 1 in at for p in at)  # a 3-token chunk starts inside a picture
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(vila_dir, prompt, out, "cpu")
    assert llm.engine.kv.pool.num_free == 36


def test_preprocessed_pixel_values_match_pictures(vila_dir):
    """The seeds' client sends VILA's processed pixels (FP16 [N, 3, 42, 42] here): the same tokens."""
    import torch

    from tests.parity.vila_reference import _load

    llm = LLM(vila_dir, device="cpu", dtype="float32")
    prompt = _prompt(4, 2)
    processor = _load(vila_dir, "cpu").processor
    pixels = torch.stack([process_image(im, processor, "resize") for im in prompt["images"]])
    sent = {"prompt": prompt["prompt"], "pixel_values": pixels}
    out = llm.generate([sent], GREEDY, use_tqdm=False)[0]
    _check(vila_dir, prompt, out, "cpu")


def test_two_tensor_parallel_shards_give_one_process_tokens(vila_dir):
    assert_two_shards_match_one(vila_dir, [_prompt(i, i % 3) for i in range(3)])
