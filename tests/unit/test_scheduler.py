"""Scheduler: token budget, chunked prefill, FCFS, preemption by recompute, no leaks on finish/abort."""

from __future__ import annotations

from mmserve.config import SchedulerConfig
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler
from mmserve.sampling_params import SamplingParams


def _sched(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        ),
        kv,
    )


def _req(rid: str, n: int) -> Request:
    return Request(rid, None, list(range(1, n + 1)), SamplingParams(max_tokens=100))


def _run_step(s: Scheduler, token: int = 7) -> dict[str, int]:
    """Schedule, pretend the model ran, append a token to each sampling request."""
    out = s.schedule()
    for sr in out.scheduled:
        sr.request.num_computed_tokens = sr.end
        if sr.samples:
            sr.request.output_token_ids.append(token)
    return {sr.request.request_id: sr.num_tokens for sr in out.scheduled}


def test_budget_chunks_long_prompt_and_decodes_ride_along():
    s = _sched(budget=10)
    s.add(_req("a", 3))
    assert _run_step(s) == {"a": 3}
    s.add(_req("b", 25))
    assert _run_step(s) == {"a": 1, "b": 9}  # decode first, then a chunk of b
    assert _run_step(s) == {"a": 1, "b": 9}
    assert _run_step(s) == {"a": 1, "b": 7}  # b's last chunk samples its first token
    assert s.running[1].num_output_tokens == 1


def test_one_token_chunks_come_first_in_a_step():
    # attention backends split a mixed batch into its leading one-query sequences (decode kernel) and the
    # rest (prefill kernel), so a step lists its one-token chunks first, each group in scheduling order
    s = _sched(budget=16)
    for rid, n in [("a", 3), ("x", 1), ("b", 4)]:
        s.add(_req(rid, n))
    out = s.schedule()
    assert [(sr.request.request_id, sr.num_tokens) for sr in out.scheduled] == [
        ("x", 1),
        ("a", 3),
        ("b", 4),
    ]
    for sr in out.scheduled:
        sr.request.num_computed_tokens = sr.end
        sr.request.output_token_ids.append(7)
    s.add(_req("c", 2))
    assert list(_run_step(s).items()) == [
        ("a", 1),
        ("x", 1),
        ("b", 1),
        ("c", 2),
    ]  # running order kept


def test_without_chunked_prefill_a_long_prompt_waits_for_room():
    s = _sched(budget=10, chunked=False)
    s.add(_req("a", 3))
    s.add(_req("b", 9))
    assert _run_step(s) == {"a": 3}
    assert _run_step(s) == {"a": 1, "b": 9}


def test_fcfs_and_max_num_seqs():
    s = _sched(max_seqs=2)
    for rid in "abc":
        s.add(_req(rid, 2))
    assert list(_run_step(s)) == ["a", "b"]
    s.finish(s.running[0], RequestStatus.FINISHED_STOPPED)
    assert list(_run_step(s)) == ["b", "c"]


def test_preemption_frees_latest_request_and_it_resumes_from_scratch():
    s = _sched(num_blocks=6, block_size=4, budget=64)
    a, b = _req("a", 8), _req("b", 8)
    s.add(a)
    s.add(b)
    _run_step(s)  # 4 blocks used, 2 free
    for _ in range(8):  # decode until the pool is exhausted
        _run_step(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1 and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and s.kv.block_ids("b") == []
    assert s.waiting[0] is b and b.num_output_tokens > 0  # generated tokens are kept
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    known = b.num_tokens
    assert _run_step(s) == {"b": known}  # recomputes prompt + its outputs at once
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free == 6


def test_abort_waiting_and_running_frees_everything():
    s = _sched()
    a, b = _req("a", 5), _req("b", 5)
    s.add(a)
    _run_step(s)
    s.add(b)
    s.finish(b, RequestStatus.FINISHED_ABORTED)  # still waiting
    s.finish(a, RequestStatus.FINISHED_ABORTED)  # running
    assert not s.has_unfinished()
    assert s.kv.pool.num_free == s.kv.num_blocks and s.kv.num_requests() == 0
