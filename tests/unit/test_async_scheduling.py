"""Async scheduling (step N+1 launched before step N's tokens are read) gives exactly what the
synchronous engine gives, and keeps its bookkeeping clean on every path (finish, stop, abort, preempt)."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine.request import PLACEHOLDER
from mmserve.testing import make_test_image


def _llm(model_dir: str, async_scheduling: bool, **kw) -> LLM:
    kw = {
        "num_kv_blocks": 256,
        "block_size": 8,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 6,
        **kw,
    }
    return LLM(model_dir, device="cpu", async_scheduling=async_scheduling, **kw)


def _prompts(n: int) -> list[dict]:
    return [
        {
            "prompt": f"USER: {'<image>' * (i % 3)}\nquestion {i} "
            + "word " * (i % 5)
            + "ASSISTANT:",
            "images": [make_test_image(30 + i * 3 + k) for k in range(i % 3)],
        }
        for i in range(n)
    ]


def _mixed_params(stop_text: str) -> list[SamplingParams]:
    """Greedy, seeded sampling, logprobs, stop strings, stop ids, min_tokens, short and long max_tokens."""
    return [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_text], ignore_eos=True),
        SamplingParams(
            max_tokens=12, temperature=0.7, top_k=5, seed=11, min_tokens=4, stop_token_ids=[3, 4, 5]
        ),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.0, seed=2, ignore_eos=True, logprobs=1),
    ]


def _summary(outs) -> list[tuple]:
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            [sorted(lp) for lp in o.outputs[0].logprobs or []],
        )
        for o in outs
    ]


@pytest.fixture(scope="module")
def stop_text(tiny_llava_dir) -> str:
    llm = _llm(tiny_llava_dir, False)
    text = (
        llm.generate(
            _prompts(4)[3],
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert len(text) > 6
    return text[4:6]


def test_async_matches_sync_on_a_mixed_batch(tiny_llava_dir, stop_text):
    prompts, params = _prompts(8), _mixed_params(stop_text)
    sync = _llm(tiny_llava_dir, False).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llava_dir, True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _summary(outs) == _summary(sync)
    assert (
        outs[3].outputs[0].finish_reason == "stop" and outs[3].outputs[0].stop_reason == stop_text
    )
    assert llm.engine.kv.usage == 0 and not llm.engine.requests and not llm.engine.has_unfinished()


def test_streamed_outputs_never_show_tokens_in_flight(tiny_llava_dir):
    llm = _llm(tiny_llava_dir, True)
    engine = llm.engine
    for i, prompt in enumerate(_prompts(4)):
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        )
    seen: dict[str, list[list[int]]] = {}
    inflight_steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.outputs[0].token_ids)
        inflight_steps += engine._inflight is not None  # noqa: SLF001 - the overlap really happens
    assert inflight_steps > 0
    for rid, stream in seen.items():
        final = stream[-1]
        assert len(final) == 8 and PLACEHOLDER not in final
        # every streamed state is a prefix of the final one, one token longer each time
        assert [len(s) for s in stream] == list(range(1, 9))
        assert all(final[: len(s)] == s for s in stream)


def test_abort_while_a_step_is_in_flight(tiny_llava_dir):
    llm = _llm(tiny_llava_dir, True)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", _prompts(2)[1], params)
    engine.add_request("b", _prompts(3)[2], params)
    while not engine.requests["a"].output_token_ids or engine._inflight is None:  # noqa: SLF001
        engine.step()
    out = engine.abort("a")
    assert out.finished and PLACEHOLDER not in out.outputs[0].token_ids
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert [o.request_id for o in rest if o.finished] == ["b"]
    assert len(rest[-1].outputs[0].token_ids) == 30
    engine.abort("b")  # unknown by now: no-op
    assert engine.kv.usage == 0 and not engine.requests
    # the engine serves on: same answer as a fresh synchronous engine
    again = llm.generate(_prompts(3)[2], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == rest[-1].outputs[0].token_ids


def test_preemption_under_a_small_pool_matches_sync(tiny_llava_dir):
    # 24 blocks of 8 tokens cannot hold six prompts with images and their outputs at once
    kw = {"num_kv_blocks": 24, "enable_prefix_caching": False}
    prompts, params = _prompts(6), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    sync = _llm(tiny_llava_dir, False, **kw).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llava_dir, True, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in sync]
    assert llm.engine.kv.usage == 0


def test_penalties_make_the_engine_wait_for_tokens_and_match_sync(tiny_llava_dir):
    prompts = _prompts(4)
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=0.7),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=10, temperature=0.0, ignore_eos=True, bad_words=["word question"]
        ),
    ]
    sync = _llm(tiny_llava_dir, False).generate(prompts, params, use_tqdm=False)
    llm = _llm(tiny_llava_dir, True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _summary(outs) == _summary(sync)
    assert not llm.engine.outputs.needs_history  # the set empties as requests finish


def test_requests_at_the_model_length_limit(tiny_llava_dir):
    prompt = _prompts(2)[1]
    for async_scheduling in (False, True):
        llm = _llm(tiny_llava_dir, async_scheduling, max_model_len=40)
        n = len(llm.engine.inputs.process(prompt).prompt_token_ids)
        out = llm.generate(
            [prompt] * 3,
            SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        assert [len(o.outputs[0].token_ids) for o in out] == [40 - n] * 3
        assert all(o.outputs[0].finish_reason == "length" for o in out)


def test_blocks_of_a_launched_step_serve_the_next_admission(tiny_llava_dir):
    """Under async scheduling the next step is scheduled before this one is read back; full blocks are
    registered at launch, so a request with the same image and prefix admitted then still hits them."""
    prompt = {
        "prompt": "USER: <image>\nquestion " + "word " * 30 + "ASSISTANT:",
        "images": [make_test_image(90)],
    }
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    hits = []
    for async_scheduling in (False, True):
        engine = _llm(tiny_llava_dir, async_scheduling, max_num_batched_tokens=256).engine
        engine.add_request("a", prompt, params)
        engine.step()  # a's whole prompt in one launched step
        second = engine.add_request("b", prompt, params)
        engine.step()
        hits.append(second.num_cached_tokens)
        while engine.has_unfinished():
            engine.step()
        assert engine.kv.usage == 0
    assert hits[0] > 0 and hits[1] == hits[0]


def test_preprocessing_makes_the_block_hashes_once_per_exact_repeat(tiny_llava_dir):
    """Engine.preprocess (run off the engine thread by servers and LLM.generate) attaches the prompt's block hash
    chain; an exact repeat gets the recent-inputs cache's same object, so its hashes are not made again, and the
    request it becomes hits the prefix cache as one hashed on the engine thread would."""
    from mmserve.engine.kv_cache import chain_block_hashes

    prompt = {
        "prompt": "USER: <image>\nquestion " + "word " * 30 + "ASSISTANT:",
        "images": [make_test_image(91)],
    }
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine = _llm(tiny_llava_dir, True, max_num_batched_tokens=256).engine
    first = engine.preprocess(prompt)
    bs, hashes = first.block_hashes
    assert bs == 8 and len(hashes) == len(first.prompt_token_ids) // 8
    assert hashes == chain_block_hashes(first.prompt_token_ids, first.mm_items, 8)
    again = engine.preprocess({"prompt": prompt["prompt"], "images": [make_test_image(91)]})
    assert again is first and again.block_hashes[1] is hashes
    a = engine.add_processed("a", first, params)
    assert a.block_hashes == hashes and a.block_hashes is not hashes  # the request's own list grows
    while engine.has_unfinished():
        engine.step()
    b = engine.add_processed("b", again, params)
    engine.step()
    assert (
        b.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 8 * 8
    )  # all but the last token's block
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.usage == 0 and hashes == chain_block_hashes(
        first.prompt_token_ids, first.mm_items, 8
    )


def test_offline_text_decoded_at_the_end_equals_the_streamed_text(tiny_llava_dir):
    """LLM.generate's requests (not streamed, no stop strings) skip per-token detokenization and decode their ids
    once when they finish; the text is what a streamed request of the same prompt shows."""
    llm = _llm(tiny_llava_dir, True)
    prompts = _prompts(5)
    params = [
        SamplingParams(
            max_tokens=12 + i, temperature=0.0, ignore_eos=True, skip_special_tokens=i % 2 == 0
        )
        for i in range(5)
    ]
    offline = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"s{i}", prompt, p)
    streamed = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] = out
    for i, out in enumerate(offline):
        ids = out.outputs[0].token_ids
        assert ids == streamed[f"s{i}"].outputs[0].token_ids
        assert out.outputs[0].text == streamed[f"s{i}"].outputs[0].text
        assert out.outputs[0].text == llm.engine.tokenizer.decode(
            ids, skip_special_tokens=params[i].skip_special_tokens
        )


def test_stop_token_sequence_ends_the_output_with_it_after_min_tokens(tiny_llava_dir):
    """A token-level stop sequence (Triton's stop_words_list) ends generation right after its last token, kept in
    the output, the same with and without async scheduling; not before min_tokens."""
    prompt = _prompts(4)[3]
    free = _llm(tiny_llava_dir, False).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    ids = free.outputs[0].token_ids
    seq = ids[2:4]
    end = next(i for i in range(2, 13) if ids[i - 2 : i] == seq)
    params = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_sequences=[seq]
    )
    for async_scheduling in (False, True):
        llm = _llm(tiny_llava_dir, async_scheduling)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ids[:end] and out.finish_reason == "stop"
        late = llm.generate(
            prompt,
            SamplingParams(
                max_tokens=12,
                temperature=0.0,
                ignore_eos=True,
                min_tokens=end + 1,
                stop_token_sequences=[seq],
            ),
            use_tqdm=False,
        )[0].outputs[0]
        later = next((i for i in range(end + 1, 13) if ids[i - 2 : i] == seq), 12)
        assert (
            late.token_ids == ids[:later]
        )  # the first occurrence came before min_tokens: it does not stop
        assert llm.engine.kv.usage == 0


def test_n_sequences_per_prompt_offline(tiny_llava_dir):
    """SamplingParams.n in LLM.generate: n requests of the prompt (sequence i seeded seed + i), one output with n
    completions in order; the engine itself refuses n > 1 by name."""
    llm = _llm(tiny_llava_dir, True)
    prompt = _prompts(3)[2]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    [out] = llm.generate(
        prompt,
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, n=3),
        use_tqdm=False,
    )
    singles = [
        llm.generate(
            prompt,
            SamplingParams(max_tokens=6, temperature=1.0, seed=3 + i, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        for i in range(3)
    ]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == singles and len({tuple(s) for s in singles}) > 1
    with pytest.raises(ValueError, match="^n: the engine runs one sequence"):
        llm.engine.add_request("x", prompt, SamplingParams(n=2))
    with pytest.raises(ValueError, match="n must be an integer"):
        SamplingParams(n=0)
    assert params.n == 1 and llm.engine.kv.usage == 0
