"""Scheduler's short way for a running request whose blocks already hold its next tokens (KVCacheManager.has_room:
no allocation, no prompt end) against always going through allocate_slots: the same steps, chunks, block tables,
preemptions and registered prefix blocks, step after step, with prompt ends kept and a pool small enough to
preempt."""

from __future__ import annotations

import random

import pytest

from mmserve.config import SchedulerConfig
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.prompt_end_cache import PromptEndCache
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.scheduler import Scheduler
from mmserve.sampling_params import SamplingParams

BS = 4


def _scheduler(short_way: bool, num_blocks: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    if not short_way:
        kv.has_room = lambda req, n: False
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24)
    return Scheduler(config, kv, PromptEndCache(8))


def _requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    return [
        Request(f"r{i}", None, rng.choice(prompts), SamplingParams(max_tokens=rng.randint(1, 20)))
        for i in range(14)
    ]


def _run(short_way: bool, seed: int, num_blocks: int) -> list[tuple]:
    """Schedule, advance and sample (a fixed token per step) until every request is done; each step's layout."""
    sched, steps = _scheduler(short_way, num_blocks), []
    pending = _requests(seed)
    for step in range(400):
        while pending and step % 2 == 0 and len(sched.waiting) < 3:
            sched.add(pending.pop(0))
        if not sched.has_unfinished() and not pending:
            break
        out = sched.schedule()
        steps.append(
            (
                [
                    (s.request.request_id, s.start, s.num_tokens, list(s.block_ids), s.samples)
                    + (s.load_prompt_end, s.store_prompt_end, s.block_row)
                    for s in out.scheduled
                ],
                [r.request_id for r in out.preempted],
                None if out.block_table is None else out.block_table.tolist(),
            )
        )
        for s in out.scheduled:
            s.request.num_computed_tokens = s.end
        sched.kv.cache_computed_blocks_of(s.request for s in out.scheduled)
        for s in out.scheduled:
            if s.samples:
                req = s.request
                req.output_token_ids.append(7 + step % 5)
                if req.num_output_tokens >= req.max_output_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
    steps.append((sched.kv.stats.hit_tokens, sched.kv.pool.num_free, sched.num_preemptions))
    return steps


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_blocks", [12, 64])
def test_the_short_way_schedules_as_allocating_does(seed, num_blocks):
    assert _run(True, seed, num_blocks) == _run(False, seed, num_blocks)


def test_every_request_attribute_lives_in_a_slot():
    """Request keeps its state in __slots__ (the hot ones first); a new attribute set in __init__ belongs there
    too, or it lands in the fallback __dict__, away from the rest."""
    req = Request(
        "a", None, [1, 2], SamplingParams(stop_token_sequences=[[1]]), bad_words_ids=[[3, 4]]
    )
    assert vars(req) == {}
    assert req.plain_sampling_from == float("inf")  # bad words: never plain greedy
