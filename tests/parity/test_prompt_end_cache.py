"""Exact repeats of a prompt sample their first token from the kept final hidden state (PromptEndCache): the
outputs still match transformers, a repeat computes nothing in its first step, and nothing leaks."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 12
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=3
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _prompt(i: int, words: int = 3) -> dict:
    return {
        "prompt": "USER: <image>\n" + " ".join(["describe"] * words) + f" {i} ASSISTANT:",
        "images": [make_test_image(7 * i + 1)],
    }


def _hits(llm: LLM) -> int:
    return llm.engine.stats()["prompt_end_cache_hits"]


def _first_step_tokens(llm: LLM, rid: str, prompt: dict, params: SamplingParams) -> int:
    """Add one request to an idle engine and return how many tokens its first step computed for it."""
    engine = llm.engine
    engine.add_request(rid, prompt, params)
    sched = engine.scheduler.schedule()
    [s] = sched.scheduled
    engine.scheduler.waiting.appendleft(s.request)  # undo: the real step below schedules it again
    engine.scheduler.running.remove(s.request)
    engine.kv.free(s.request)
    s.request.num_computed_tokens = 0
    return s.num_tokens


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_exact_repeat_samples_its_first_token_from_the_kept_state(
    tiny_llava_dir, device, block_size
):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", block_size=block_size)
    prompt = _prompt(1)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert _hits(llm) == 0
    repeat = {
        "prompt": prompt["prompt"],
        "images": [make_test_image(8)],
    }  # same picture, a new object
    second = llm.generate([repeat], GREEDY, use_tqdm=False)[0]
    assert _hits(llm) == 1
    p = len(second.prompt_token_ids)
    assert second.metrics.num_cached_tokens == (p - 1) // block_size * block_size
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    check_against_hf(tiny_llava_dir, repeat, second, N, device)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_a_repeat_computes_nothing_in_its_first_step_and_finishes_alone(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", block_size=4)
    prompt = _prompt(2)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    assert _first_step_tokens(llm, "probe", prompt, one) > 0
    llm.engine.abort("probe")
    first = llm.generate([prompt], one, use_tqdm=False)[0]
    assert _first_step_tokens(llm, "again", prompt, one) == 0
    llm.engine.abort("again")
    # max_tokens 1: the first token is the whole answer; the prompt's tail is never computed
    second = llm.generate([prompt], one, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].finish_reason == "length"
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
    assert not llm.engine.requests


@pytest.mark.parametrize("device", DEVICES)
def test_repeats_joining_a_running_batch_match_transformers(tiny_llava_dir, device):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", block_size=4)
    prompts = [_prompt(i, words=i + 1) for i in range(3)]
    firsts = llm.generate(prompts, GREEDY, use_tqdm=False)
    # each repeat joins while others decode: its load shares a step with their decodes, and its tail is then
    # computed next to them (the first prompt also comes twice in a row)
    again = [_prompt(5)] + [prompts[0], prompts[0], prompts[2], prompts[1]]
    outs = run_staggered(llm.engine, again, GREEDY)
    assert _hits(llm) >= 3
    for out, want in zip(outs[1:], [firsts[0], firsts[0], firsts[2], firsts[1]]):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    for prompt, out in zip(again, outs):
        check_against_hf(tiny_llava_dir, prompt, out, N, device)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_a_forgotten_prompt_is_computed_again(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", block_size=4, prompt_end_cache_size=1)
    a, b = _prompt(3), _prompt(4)
    first = llm.generate([a], GREEDY, use_tqdm=False)[0]
    llm.generate([b], GREEDY, use_tqdm=False)  # takes the only slot
    again = llm.generate([a], GREEDY, use_tqdm=False)[0]
    assert _hits(llm) == 0
    assert (
        again.metrics.num_cached_tokens > 0
    )  # its blocks were still cached: a prefix hit, not a prompt-end one
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_off_when_asked_or_without_prefix_caching(tiny_llava_dir):
    for kwargs in ({"prompt_end_cache_size": 0}, {"enable_prefix_caching": False}):
        llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", block_size=4, **kwargs)
        prompt = _prompt(6)
        first = llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
        second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert _hits(llm) == 0 and llm.engine.runner.sampling.prompt_ends is None
        assert (
            second.outputs[0].token_ids
            == first[0].outputs[0].token_ids
            == first[1].outputs[0].token_ids
        )


def test_a_step_that_fails_to_launch_leaves_no_kept_state_behind(tiny_llava_dir, monkeypatch):
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", block_size=4)
    engine = llm.engine
    prompt = _prompt(7)
    engine.add_request("x", prompt, GREEDY)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "launch", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.step()
    engine.abort("x")
    # the failed step claimed a slot for x's prompt and wrote nothing: the prompt must be computed again
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert _hits(llm) == 0
    check_against_hf(tiny_llava_dir, prompt, out, N, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_a_prompt_completed_by_a_one_token_chunk_is_kept_too(tiny_llava_dir, device):
    # on CUDA a one-token chunk rides the decode step's CUDA graph, whose final hidden states are kept from there
    from transformers import AutoProcessor

    prompt = _prompt(9)
    p = len(
        AutoProcessor.from_pretrained(tiny_llava_dir)(
            text=prompt["prompt"], images=prompt["images"], return_tensors="pt"
        )["input_ids"][0]
    )
    llm = LLM(
        tiny_llava_dir, device=device, dtype="float32", block_size=4, max_num_batched_tokens=p - 1
    )
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert len(first.prompt_token_ids) == p
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert _hits(llm) == 1
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    check_against_hf(tiny_llava_dir, prompt, second, N, device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_burst_of_one_prompt_computes_it_once(tiny_llava_dir, device):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", block_size=4)
    engine = llm.engine
    prompt, other = _prompt(11), _prompt(12)
    for i, p in enumerate([prompt, prompt, other, prompt]):  # all waiting before the first step
        engine.add_request(str(i), p, GREEDY)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    outs = [done[str(i)] for i in range(4)]
    assert (
        _hits(llm) == 2
    )  # the first copy computes the prompt; the other two wait a step for it and load
    assert outs[1].metrics.num_cached_tokens == outs[3].metrics.num_cached_tokens > 0
    assert (
        outs[2].metrics.num_cached_tokens == 0
    )  # admitted in the first step, past the waiting copies
    assert (
        outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids
    )
    for p, out in zip([prompt, other], [outs[3], outs[2]]):
        check_against_hf(tiny_llava_dir, p, out, N, device)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks
