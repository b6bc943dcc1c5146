"""Greedy ids and log-probs of mmserve vs the eager CogVLM reference (tests/parity/cogvlm_reference.py) on tiny random
CogVLM (v1: MHA, vicuna tokenizer in tokenizer/) and CogVLM2 (v2: GQA, vision q/k/v bias, 2×2 conv) checkpoints in
their published layouts.

The visual expert takes a picture's rows but eoi, positions share one value over the patches; both must stay right
in prefill, in chunks cut anywhere in the picture's span (inside, at boi, at eoi), in decode, on prefix-cache hits,
after preemption and over two tensor-parallel shards.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.cogvlm import chat_prompt, make_cogvlm2_checkpoint, make_cogvlm_checkpoint
from tests.parity.cogvlm_reference import reference_greedy
from tests.parity.hf_oracle import assert_matches_oracle, assert_two_shards_match_one, run_staggered

N = 32
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {"cpu": 2e-3, "cuda": 1e-2}
ROWS = 6  # boi + 2×2 patches + eoi in both tiny presets


@pytest.fixture(scope="module", params=["v1", "v2"])
def cogvlm_dir(request, tmp_path_factory) -> str:
    make = make_cogvlm_checkpoint if request.param == "v1" else make_cogvlm2_checkpoint
    return str(make(tmp_path_factory.mktemp(f"cogvlm_{request.param}")))


def _prompt(i: int, image: bool = True) -> dict:
    words = " ".join(["what is in it"] * (i % 3 + 1))
    prompt = {"prompt": chat_prompt(f"{words} number {i}?")}
    if image:
        prompt["images"] = [make_test_image(10 * i, (40 + 4 * i, 36))]
    return prompt


def _check(model_dir: str, prompt: dict, out, device: str) -> None:
    oracle = reference_greedy(model_dir, prompt["prompt"], prompt.get("images"), N, device)
    assert_matches_oracle(out, oracle, TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_picture_and_text_only_match_the_reference(cogvlm_dir, device):
    llm = LLM(cogvlm_dir, device=device, dtype="float32")
    for prompt in (_prompt(0), _prompt(1, image=False)):
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert len(out.prompt_token_ids) - 1 - ROWS * ("images" in prompt) > 0
        _check(cogvlm_dir, prompt, out, device)


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_and_prefix_hits_match(cogvlm_dir, device):
    llm = LLM(cogvlm_dir, device=device, dtype="float32", block_size=4)
    engine = llm.engine
    prompts = [_prompt(i, image=i % 3 != 2) for i in range(6)]
    outs = run_staggered(engine, prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        _check(cogvlm_dir, prompt, out, device)
    # the same picture (a fresh object) behind the same text: the picture's blocks come from the cache
    again = {"prompt": prompts[1]["prompt"], "images": [make_test_image(10, (44, 36))]}
    hit = llm.generate([again], GREEDY, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= 4
    _check(cogvlm_dir, again, hit, device)
    other = {"prompt": prompts[1]["prompt"], "images": [make_test_image(99, (44, 36))]}
    miss = llm.generate([other], GREEDY, use_tqdm=False)[0]
    assert miss.metrics.num_cached_tokens == 0  # the picture sits right after BOS
    _check(cogvlm_dir, other, miss, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 6])
def test_chunks_cut_anywhere_in_the_picture_match(cogvlm_dir, chunk):
    """Chunk sizes putting a boundary at boi, inside the patches, right before and after eoi."""
    llm = LLM(
        cogvlm_dir,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    prompt = _prompt(3)
    _check(cogvlm_dir, prompt, llm.generate([prompt], GREEDY, use_tqdm=False)[0], "cpu")


def test_preemption_matches(cogvlm_dir):
    llm = LLM(
        cogvlm_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=30,
        enable_prefix_caching=False,
    )
    prompts = [_prompt(i) for i in range(4)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(cogvlm_dir, prompt, out, "cpu")
    assert llm.engine.kv.pool.num_free == 30


def test_two_tensor_parallel_shards_give_one_process_tokens(cogvlm_dir):
    assert_two_shards_match_one(cogvlm_dir, [_prompt(i, image=i != 1) for i in range(3)])


def test_two_pictures_are_refused(cogvlm_dir):
    llm = LLM(cogvlm_dir, device="cpu", dtype="float32")
    two = {"prompt": "Question: hi Answer:", "images": [make_test_image(1), make_test_image(2)]}
    with pytest.raises(ValueError, match="at most one image"):
        llm.generate([two], GREEDY, use_tqdm=False)
