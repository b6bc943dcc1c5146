"""Greedy ids and log-probs of mmserve vs the eager InternLM-XComposer2 reference (tests/parity/xcomposer2_reference.py)
on tiny random checkpoints in the published layout (`.bin` shards, packed `wqkv`, Partial LoRA on every linear).

The Partial LoRA must land on picture rows only: in prefill, in chunks cut anywhere in a picture's span, never on
decode rows, on prefix-cache hits, after preemption, over two tensor-parallel shards and with CUDA graphs on
(decode steps replay them: no rows baked in).
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.internlm_xcomposer2 import make_internlm_xcomposer2_checkpoint
from tests.parity.hf_oracle import assert_matches_oracle, assert_two_shards_match_one, run_staggered
from tests.parity.xcomposer2_reference import reference_greedy

N = 32
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {"cpu": 2e-3, "cuda": 1e-2}
SYSTEM = "[UNUSED_TOKEN_146]system\nYou are an AI assistant.[UNUSED_TOKEN_145]\n"


@pytest.fixture(scope="module")
def xc_dir(tmp_path_factory) -> str:
    return str(make_internlm_xcomposer2_checkpoint(tmp_path_factory.mktemp("xcomposer2")))


def _prompt(i: int, num_images: int) -> dict:
    tags = "<ImageHere>" * num_images
    words = " ".join(["describe it"] * (i % 3 + 1))
    user = f"[UNUSED_TOKEN_146]user\n{tags}{words} {i}[UNUSED_TOKEN_145]\n"
    return {
        "prompt": SYSTEM + user + "[UNUSED_TOKEN_146]assistant\n",
        "images": [make_test_image(10 * i + k, (36 + 6 * k, 30)) for k in range(num_images)],
    }


def _check(model_dir: str, prompt: dict, out, device: str) -> None:
    oracle = reference_greedy(model_dir, prompt["prompt"], prompt.get("images"), N, device)
    assert_matches_oracle(out, oracle, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_pictures_and_text_only_match_the_reference(xc_dir, device):
    llm = LLM(xc_dir, device=device, dtype="float32")
    assert llm.engine.model.builtin_lora is not None
    for prompt in (_prompt(0, 1), _prompt(1, 0), _prompt(2, 2)):
        _check(xc_dir, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_prefix_hits_and_chunks_match(xc_dir, device):
    llm = LLM(xc_dir, device=device, dtype="float32", block_size=4, max_num_batched_tokens=5)
    engine = llm.engine
    prompts = [_prompt(i, i % 3) for i in range(6)]
    for prompt, out in zip(prompts, run_staggered(engine, prompts, GREEDY)):
        _check(xc_dir, prompt, out, device)
    again = {"prompt": prompts[1]["prompt"], "images": [make_test_image(10, (36, 30))]}
    hit = llm.generate([again], GREEDY, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= 16
    _check(xc_dir, again, hit, device)
    other = {"prompt": prompts[1]["prompt"], "images": [make_test_image(77, (36, 30))]}
    miss = llm.generate([other], GREEDY, use_tqdm=False)[0]
    assert miss.metrics.num_cached_tokens <= miss.prompt_token_ids.index(0)  # not past the picture
    _check(xc_dir, other, miss, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_preemption_matches(xc_dir):
    llm = LLM(
        xc_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=44,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
    )
    prompts = [_prompt(i, 1) for i in range(4)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(xc_dir, prompt, out, "cpu")


def test_two_tensor_parallel_shards_give_one_process_tokens(xc_dir):
    assert_two_shards_match_one(xc_dir, [_prompt(i, i % 3) for i in range(3)])
