"""PromptEndCache (digest -> slot, LRU) and the prompt digest it is keyed by; the scheduler's use of both."""

from __future__ import annotations

import torch

from mmserve.config import SchedulerConfig
from mmserve.core.multimodal import MultiModalItem
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.prompt_end_cache import PromptEndCache
from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler
from mmserve.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], images: list[tuple[int, int, str]] = ()) -> Request:
    items = [
        MultiModalItem("image", {"pixel_values": torch.zeros(1)}, off, n, h) for off, n, h in images
    ]
    return Request(rid, None, tokens, SamplingParams(max_tokens=4), items)


def test_slots_are_reused_for_the_same_prompt_and_evicted_least_recently_used_first():
    cache = PromptEndCache(2)
    a, b = cache.claim(b"a"), cache.claim(b"b")
    assert {a, b} == {0, 1}
    assert cache.claim(b"a") == a  # the same prompt again: its own slot
    assert cache.lookup(b"b") == b  # b is now the most recently used
    c = cache.claim(b"c")
    assert c == a and cache.lookup(b"a") is None and cache.lookup(b"b") == b
    cache.forget(b"c")  # a failed launch: the slot is free again, c unknown
    assert cache.lookup(b"c") is None
    assert cache.claim(b"d") == c and cache.lookup(b"b") == b


def test_the_digest_covers_every_prompt_token_and_picture_and_no_block_shares_it():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    base = list(range(1, 11))
    digest = kv.prompt_digest(_req("a", base))
    assert digest == kv.prompt_digest(_req("b", base))
    assert digest != kv.prompt_digest(_req("c", base[:-1] + [99]))  # the last token
    assert digest != kv.prompt_digest(_req("d", [99] + base[1:]))  # the first (through the chain)
    assert digest != kv.prompt_digest(_req("e", base[:-1]))  # a prefix of it
    with_image = kv.prompt_digest(_req("f", base, [(8, 2, "img1")]))  # picture in the partial block
    assert with_image not in (digest, kv.prompt_digest(_req("g", base, [(8, 2, "img2")])))
    aligned = _req("h", base[:8])  # no partial block
    assert kv.prompt_digest(aligned) not in aligned.block_hashes


def _sched(num_slots: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, PromptEndCache(num_slots))


def _finish_step(s: Scheduler) -> None:
    out = s.schedule()
    for sr in out.scheduled:
        sr.request.num_computed_tokens = sr.end
        s.kv.cache_computed_blocks(sr.request)
        if sr.samples:
            sr.request.output_token_ids.append(7)


def test_scheduler_stores_a_completed_prompt_and_loads_it_for_a_repeat_last_in_the_step():
    s = _sched()
    s.add(_req("a", list(range(1, 11))))
    out = s.schedule()
    [first] = out.scheduled
    assert first.num_tokens == 10 and first.samples and first.store_prompt_end is not None
    first.request.num_computed_tokens = 10
    s.kv.cache_computed_blocks(first.request)
    first.request.output_token_ids.append(7)
    s.add(_req("b", [50, 51, 52]))
    s.add(_req("a2", list(range(1, 11))))
    out = s.schedule()
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [
        ("a", 1),
        ("b", 3),
        ("a2", 0),
    ]
    load = out.scheduled[-1]
    assert load.samples and load.load_prompt_end == first.store_prompt_end and load.start == 8
    assert out.computed == out.scheduled[:2] and out.kind == "mixed"
    assert out.scheduled[0].store_prompt_end is None  # a decode stores nothing
    for x in out.scheduled:
        x.request.num_computed_tokens = x.end
        x.request.output_token_ids.append(7)
    out = s.schedule()
    # the repeat's next step: the prompt's uncached tail (positions 8, 9) and its first token
    assert [
        (x.request.request_id, x.start, x.num_tokens)
        for x in out.scheduled
        if x.request.request_id == "a2"
    ] == [("a2", 8, 3)]
    assert all(x.store_prompt_end is None for x in out.scheduled)


def test_a_partial_prefix_hit_computes_the_prompt():
    s = _sched()
    s.add(_req("a", list(range(1, 11))))
    _finish_step(s)
    s.kv.free(
        s.running.pop()
    )  # a's blocks are free, the tail first in the LRU queue: cached until evicted
    taken = s.kv.pool.take(s.kv.pool.num_free - 1)  # evicts all of a's blocks but the first
    s.kv.pool.release(taken)
    s.add(_req("a2", list(range(1, 11))))
    [x] = s.schedule().scheduled
    assert x.start == 4 and x.num_tokens == 6 and x.load_prompt_end is None


def test_a_twin_of_a_prompt_in_progress_waits_and_lets_others_pass():
    s = _sched()
    prompt = list(range(1, 11))
    for rid, tokens in [("a", prompt), ("a2", prompt), ("b", [50, 51, 52]), ("a3", prompt)]:
        s.add(_req(rid, tokens))
    out = s.schedule()
    # a computes the prompt; its twins wait for it, b (another prompt) is admitted past them
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 10), ("b", 3)]
    assert [r.request_id for r in s.waiting] == ["a2", "a3"]
    for x in out.scheduled:
        x.request.num_computed_tokens = x.end
        s.kv.cache_computed_blocks(x.request)
        x.request.output_token_ids.append(7)
    out = s.schedule()
    loads = [
        (x.request.request_id, x.num_tokens, x.load_prompt_end)
        for x in out.scheduled
        if x.num_tokens == 0
    ]
    assert [(rid, n) for rid, n, _ in loads] == [("a2", 0), ("a3", 0)] and all(
        l is not None for *_, l in loads
    )
    assert not s.waiting


def test_a_long_prompt_in_chunks_keeps_its_twin_waiting_until_the_last_chunk():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8), kv, PromptEndCache(4))
    prompt = list(range(1, 21))
    s.add(_req("a", prompt))
    s.add(_req("a2", prompt))
    chunks = []
    for _ in range(4):
        out = s.schedule()
        twins = [x for x in out.scheduled if x.request.request_id == "a2"]
        if twins:
            break
        chunks += [x.num_tokens for x in out.scheduled]
        for x in out.scheduled:
            x.request.num_computed_tokens = x.end
            kv.cache_computed_blocks(x.request)
            if x.samples:
                x.request.output_token_ids.append(7)
    assert chunks == [8, 8, 4]
    [twin] = twins
    assert twin.num_tokens == 0 and twin.load_prompt_end is not None
