"""Block manager: allocation, refcounts, prefix hits by chained hashes (image-aware), LRU eviction, no leaks."""

from __future__ import annotations

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.engine.kv_cache import BlockTableRows, KVCacheManager, chain_block_hashes, hash_block
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], images: list[tuple[int, int, str]] = ()) -> Request:
    items = [
        MultiModalItem("image", {"pixel_values": torch.zeros(1)}, off, n, h) for off, n, h in images
    ]
    return Request(rid, None, tokens, SamplingParams(max_tokens=4), items)


def _computed(kv: KVCacheManager, req: Request) -> Request:
    """req's whole prompt allocated, computed and registered in the prefix cache."""
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return req


def test_allocate_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3 and kv.pool.num_free == 7
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 1)  # 11th token fits in block 3
    assert len(kv.block_ids("a")) == 3
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1)  # 13th token needs a 4th block
    assert len(kv.block_ids("a")) == 4
    kv.free(r)
    assert kv.pool.num_free == 10 and kv.num_requests() == 0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r = _req("a", list(range(20)))
    assert not kv.allocate_slots(r, 20)
    assert kv.pool.num_free == 3 and kv.block_ids("a") == []


def test_same_prefix_shares_blocks_and_refcounts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = _computed(kv, _req("a", list(range(13))))
    b = _req("b", list(range(12)) + [99, 98])
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and [x.block_id for x in hits] == kv.block_ids("a")[:3]
    assert kv.allocate_slots(b, 2, hits)
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("a")[:3]] == [2, 2, 2]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("b")[:3]] == [1, 1, 1]
    kv.free(b)
    assert kv.pool.num_free == 16


def test_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    _computed(kv, _req("a", list(range(8))))
    _, n = kv.get_computed_blocks(_req("b", list(range(8))))
    assert n == 4  # the last block is recomputed so the final position yields logits


def test_image_content_hash_decides_hits_not_placeholder_ids():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = [1, 2, 7, 7, 7, 7, 7, 7, 3, 4, 5]
    _computed(kv, _req("a", tokens, [(2, 6, "cat")]))
    _, same = kv.get_computed_blocks(_req("b", tokens, [(2, 6, "cat")]))
    _, other = kv.get_computed_blocks(_req("c", tokens, [(2, 6, "dog")]))
    assert same == 8
    assert other == 0  # block 0 already holds two image tokens of a different image


def test_lru_evicts_least_recently_freed_and_keeps_prefix_longest():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _computed(kv, _req("a", [1, 2, 3, 4, 5]))
    first, second, tail = kv.block_ids("a")
    kv.free(a)  # tail first into the LRU, then block 2, then block 1
    c = _req("c", [50, 51])
    kv.allocate_slots(c, 2)  # takes the never-used block, then evicts in LRU order
    d = _req("d", [60, 61])
    kv.allocate_slots(d, 2)
    assert kv.block_ids("d") == [tail]
    # the prefix blocks survive the eviction of the tail
    _, n = kv.get_computed_blocks(_req("e", [1, 2, 3, 4, 9]))
    assert n == 4 and {first, second}.isdisjoint(kv.block_ids("c") + kv.block_ids("d"))


def test_free_cached_blocks_count_against_allocation_when_hit():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = _computed(kv, _req("a", [1, 2, 3, 4]))
    kv.free(a)
    b = _req("b", [1, 2, 3, 4, 5, 6, 7, 8])
    hits, n = kv.get_computed_blocks(b)
    assert n == 4
    # 4 hit tokens + 4 new need 4 blocks; only 3 exist, and the 2 hits are no longer allocatable
    assert not kv.allocate_slots(b, 4, hits)
    assert all(x.ref_cnt == 0 for x in kv.pool.blocks) and kv.pool.num_free == 3


def test_block_hashes_are_sha256_chains_over_every_field():
    base = hash_block(None, [1, 2, 3, 4], [("img-a", 0)])
    assert isinstance(base, bytes) and len(base) == 32
    assert hash_block(None, [1, 2, 3, 4], [("img-a", 0)]) == base  # deterministic
    variants = [
        hash_block(None, [1, 2, 3, 5], [("img-a", 0)]),  # a token
        hash_block(None, [1, 2, 3, 4], [("img-b", 0)]),  # the picture
        hash_block(None, [1, 2, 3, 4], [("img-a", 4)]),  # where in the picture
        hash_block(None, [1, 2, 3, 4], []),  # no picture
        hash_block(base, [1, 2, 3, 4], [("img-a", 0)]),  # the prefix before it
        hash_block(None, [1, 2, 3, 4], [("img-a", 0), ("", 0)]),
    ]  # fields cannot run together
    assert len({base, *variants}) == 1 + len(variants)
    # a request's chain: the same tokens and picture behind a different first block hash differently
    kv = KVCacheManager(16, 4)
    a = _req("a", [9, 9, 9, 9, 1, 2, 3, 4, 5])
    b = _req("b", [8, 9, 9, 9, 1, 2, 3, 4, 5])
    kv._extend_hashes(a)  # noqa: SLF001 - the chain itself is what is checked
    kv._extend_hashes(b)  # noqa: SLF001
    assert len(a.block_hashes) == 2 and a.block_hashes[1] != b.block_hashes[1]
    assert a.block_hashes[1] == hash_block(a.block_hashes[0], [1, 2, 3, 4], [])


def test_chain_block_hashes_match_block_by_block_hashing():
    tokens = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens
    req = _req("r", tokens, [(3, 6, "pic")])  # placeholders at positions 3..8
    item = req.mm_items[0]
    want, parent = [], None
    for start, media in [(0, [("pic", 0)]), (4, [("pic", 1)]), (8, [("pic", 5)])]:
        parent = hash_block(parent, tokens[start : start + 4], media)
        want.append(parent)
    assert chain_block_hashes(tokens, [item], 4) == want
    # continued from a known parent, as a request's chain grows while it decodes
    assert chain_block_hashes(tokens[4:], [item], 4, first_block=1, parent=want[0]) == want[1:]
    KVCacheManager(16, 4)._extend_hashes(req)  # noqa: SLF001
    assert req.block_hashes == want


def test_block_ids_follow_the_block_table_through_hits_growth_failures_and_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = _computed(kv, _req("a", list(range(9))))
    ids = kv.block_ids("a")
    assert ids == [b.block_id for b in kv._tables["a"]] and len(ids) == 3  # noqa: SLF001
    assert (
        kv.allocate_slots(a, 4) and kv.block_ids("a") is ids and len(ids) == 4
    )  # grown in place, no copy
    b = _req("b", list(range(9)) + [50, 51])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and kv.allocate_slots(b, 3, hits)
    assert kv.block_ids("b")[:2] == ids[:2] and kv.block_ids("b") == [
        x.block_id for x in kv._tables["b"]
    ]  # noqa: SLF001
    c = _req("c", list(range(100, 130)))
    assert (
        not kv.allocate_slots(c, 30) and kv.block_ids("c") == []
    )  # too few blocks: nothing changes
    kv.free(a)
    assert (
        kv.block_ids("a") == [] and len(ids) == 4
    )  # a step that kept the list still reads what it had


def test_caching_a_steps_requests_registers_only_blocks_that_became_full():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a, b = _req("a", list(range(10))), _req("b", list(range(50, 56)))
    assert kv.allocate_slots(a, 10) and kv.allocate_slots(b, 6)
    a.num_computed_tokens, b.num_computed_tokens = 8, 3  # a: two full blocks; b: none yet
    kv.cache_computed_blocks_of([a, b])
    assert [blk.block_hash is not None for blk in kv._tables["a"]] == [True, True, False]  # noqa: SLF001
    assert all(blk.block_hash is None for blk in kv._tables["b"])  # noqa: SLF001
    b.num_computed_tokens = 6  # b's first block is full now; a has nothing new
    kv.cache_computed_blocks_of([a, b])
    assert [blk.block_hash is not None for blk in kv._tables["b"]] == [True, False]  # noqa: SLF001
    # a later request with b's prompt hits the block registered above
    hits, n = kv.get_computed_blocks(_req("c", list(range(50, 56))))
    assert n == 4 and hits == kv._tables["b"][:1]  # noqa: SLF001
    off = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    d = _req("d", list(range(8)))
    assert off.allocate_slots(d, 8)
    d.num_computed_tokens = 8
    off.cache_computed_blocks_of([d])
    assert all(blk.block_hash is None for blk in off._tables["d"])  # noqa: SLF001


def test_block_table_rows_hold_each_requests_ids_zero_padded_through_growth_and_reuse():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    kv.rows = BlockTableRows(rows=1, width=2)  # small, so that both its rows and its columns grow
    a, b = _req("a", list(range(6))), _req("b", list(range(100, 103)))
    assert kv.allocate_slots(a, 6) and kv.allocate_slots(b, 3)
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 7)  # 13 tokens: 4 blocks, wider than the array was

    def row(r):
        return kv.rows.array[kv.rows.row(r.request_id)].tolist()

    width = kv.rows.array.shape[1]
    assert row(a) == kv.block_ids("a") + [0] * (width - 4)
    assert row(b) == kv.block_ids("b") + [0] * (width - 1)
    kv.free(a)
    assert kv.rows.row("a") == -1
    c = _req("c", list(range(200, 205)))
    assert kv.allocate_slots(c, 5)  # takes a's row again: nothing of a's ids is left in it
    assert row(c) == kv.block_ids("c") + [0] * (width - 2)
