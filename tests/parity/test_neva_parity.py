"""Greedy ids and log-probs of mmserve vs the eager NeVA reference (tests/parity/neva_reference.py) on tiny random
`.nemo` checkpoints served as they are: "tiny" (NVGPT style: LayerNorm1P, squared-ReLU, rotary over half of each
head, grouped queries, SigLIP) and "tiny-swiglu" (RMSNorm, SwiGLU, full rotary, CLIP with its CLS dropped)."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.neva import chat_prompt, make_neva_checkpoint
from tests.parity.hf_oracle import assert_matches_oracle, assert_two_shards_match_one, run_staggered
from tests.parity.neva_reference import reference_greedy

N = 24
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {"cpu": 2e-3, "cuda": 1e-2}


@pytest.fixture(scope="module", params=["tiny", "tiny-swiglu"])
def neva_dir(request, tmp_path_factory) -> str:
    return str(make_neva_checkpoint(tmp_path_factory.mktemp("neva"), preset=request.param))


def _prompt(i: int, num_images: int) -> dict:
    words = " ".join(["what is in it"] * (i % 3 + 1))
    return {
        "prompt": chat_prompt(f"{words} {i}?", images=num_images),
        "images": [make_test_image(10 * i + k, (40, 32 + 8 * k)) for k in range(num_images)],
    }


def _check(model_dir: str, prompt: dict, out, device: str) -> None:
    oracle = reference_greedy(model_dir, prompt["prompt"], prompt.get("images"), N, device)
    assert_matches_oracle(out, oracle, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_picture_and_text_only_match_the_reference(neva_dir, device):
    llm = LLM(neva_dir, device=device, dtype="float32")
    for prompt in (_prompt(0, 1), _prompt(1, 0), _prompt(2, 2)):
        _check(neva_dir, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_prefix_hits_chunks_and_preemption_match(neva_dir, device):
    llm = LLM(
        neva_dir,
        device=device,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=5,
        num_kv_blocks=30,
    )
    engine = llm.engine
    prompts = [_prompt(i, 1 if i % 3 else 0) for i in range(5)]
    for prompt, out in zip(prompts, run_staggered(engine, prompts, GREEDY)):
        _check(neva_dir, prompt, out, device)
    assert engine.scheduler.num_preemptions > 0
    again = {"prompt": prompts[1]["prompt"], "images": [make_test_image(10, (40, 32))]}
    hit = llm.generate([again], GREEDY, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= 8
    _check(neva_dir, again, hit, device)
    other = {"prompt": prompts[1]["prompt"], "images": [make_test_image(77, (40, 32))]}
    miss = llm.generate([other], GREEDY, use_tqdm=False)[0]
    placeholder = llm.engine.inputs.processor.placeholder_id
    assert miss.metrics.num_cached_tokens <= miss.prompt_token_ids.index(placeholder)
    _check(neva_dir, other, miss, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_two_tensor_parallel_shards_give_one_process_tokens(neva_dir):
    assert_two_shards_match_one(neva_dir, [_prompt(i, i % 2) for i in range(3)])
