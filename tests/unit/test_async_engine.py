"""AsyncEngine: streaming, abort when the consumer leaves, and failures reported instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from mmserve import LLM, SamplingParams
from mmserve.engine.async_engine import AsyncEngine


@pytest.fixture()
def engine(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, device="cpu")
    ae = AsyncEngine(llm.engine)
    yield ae
    ae.shutdown()


async def _collect(ae, prompt, params):
    return [o async for o in ae.generate(prompt, params)]


def test_stream_is_cumulative_and_ends_finished(engine):
    outs = asyncio.run(
        _collect(engine, "USER: hi ASSISTANT:", SamplingParams(max_tokens=5, ignore_eos=True))
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 5] and outs[-1].finished


def test_leaving_the_stream_aborts_and_frees_blocks(engine):
    async def read_two():
        stream = engine.generate(
            "USER: hi ASSISTANT:", SamplingParams(max_tokens=300, ignore_eos=True)
        )
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        for _ in range(100):
            if engine.stats()["kv_cache_usage"] == 0 and engine.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
        return got

    got = asyncio.run(read_two())
    assert len(got) == 2 and engine.stats()["kv_cache_usage"] == 0


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine):
    real_step, calls = engine.engine.step, []

    def broken_once():
        if not calls:
            calls.append(1)
            raise RuntimeError("boom")
        return real_step()

    engine.engine.step = broken_once
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(_collect(engine, "USER: hi ASSISTANT:", SamplingParams(max_tokens=3)))
    outs = asyncio.run(
        _collect(engine, "USER: again ASSISTANT:", SamplingParams(max_tokens=3, ignore_eos=True))
    )
    assert outs[-1].finished and engine.stats()["kv_cache_usage"] == 0


def test_a_failure_while_a_step_is_in_flight_leaves_the_engine_clean(engine):
    """Async scheduling: reading step N back fails after step N+1 was launched; both steps' requests
    fail, nothing leaks, and later requests get the same answer as before."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = (
        asyncio.run(_collect(engine, "USER: again ASSISTANT:", params))[-1].outputs[0].token_ids
    )
    real_resolve, calls = engine.engine.outputs.resolve, []

    def broken_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_resolve(*args)

    engine.engine.outputs.resolve = broken_third
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(
            _collect(engine, "USER: hi ASSISTANT:", SamplingParams(max_tokens=20, ignore_eos=True))
        )
    after = asyncio.run(_collect(engine, "USER: again ASSISTANT:", params))[-1].outputs[0].token_ids
    assert (
        after == before
        and engine.stats()["kv_cache_usage"] == 0
        and engine.stats()["num_running"] == 0
    )


def test_a_dead_engine_loop_is_reported_not_hung(engine):
    def crash(cmd):
        raise SystemError("engine thread crashed")

    engine._handle = crash  # the next command kills the loop
    with pytest.raises(RuntimeError, match="crashed"):
        asyncio.run(
            asyncio.wait_for(
                _collect(engine, "USER: hi ASSISTANT:", SamplingParams(max_tokens=3)), 10
            )
        )
    assert engine.dead_error is not None
    with pytest.raises(RuntimeError, match="has stopped"):
        asyncio.run(_collect(engine, "USER: hi ASSISTANT:", SamplingParams(max_tokens=3)))
