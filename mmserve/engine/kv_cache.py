"""Paged KV cache bookkeeping: BlockPool (ids, refcounts, LRU of free blocks) and KVCacheManager
(per-request block tables and prefix caching by chained block hashes).

A block's hash chains its parent's hash, its token ids and the content hashes of the images whose
placeholder tokens it holds, so the same image behind the same prefix maps to the same blocks. The hash is
sha256: with a fast non-cryptographic hash, a crafted prompt could be made to collide with another user's
cached blocks and read their keys and values.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from mmserve.core.transfer import cdiv
from mmserve.engine.request import Request

_BLOCK_HASH_SEED = hashlib.sha256(
    b"mmserve-kv-block\0"
)  # copied for each block: the prefix is hashed once


def hash_block(
    parent: bytes | None, token_ids: Sequence[int], media: Sequence[tuple[str, int]]
) -> bytes:
    """sha256 digest of a full block: its parent block's digest (None for the first block), its token ids
    and, for each media item with placeholders in it, (content hash, index of the item's first placeholder
    that falls in this block). Every field is length-prefixed, so no two inputs share a byte stream."""
    h = _BLOCK_HASH_SEED.copy()
    h.update(parent if parent is not None else b"\0" * 32)
    ids = array("q", token_ids).tobytes()
    h.update(len(ids).to_bytes(8, "little"))
    h.update(ids)
    for content_hash, offset in media:
        key = content_hash.encode()
        h.update(len(key).to_bytes(8, "little"))
        h.update(key)
        h.update(offset.to_bytes(8, "little"))
    return h.digest()


def chain_block_hashes(
    token_ids: Sequence[int],
    mm_items: Sequence,
    block_size: int,
    first_block: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """hash_block of full blocks first_block, first_block + 1, ... of a sequence whose tokens from position
    first_block * block_size on are token_ids, chained from `parent` (the digest of block first_block - 1).
    mm_items: the sequence's media items (offset, end, content_hash), sorted by offset."""
    out = []
    for i in range(len(token_ids) // block_size):
        start = (first_block + i) * block_size
        parent = hash_block(
            parent,
            token_ids[i * block_size : (i + 1) * block_size],
            _media_in(mm_items, start, start + block_size),
        )
        out.append(parent)
    return out


def _media_in(mm_items: Sequence, start: int, end: int) -> list[tuple[str, int]]:
    """hash_block's media field for token positions [start, end)."""
    out = []
    for m in mm_items:
        first = m.offset if m.kv_from is None else m.kv_from
        if first < end and m.end > start:
            out.append((m.content_hash, max(start, first) - first))
    return out


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full, computed and registered


class BlockPool:
    """All KV blocks. Free blocks sit in an LRU queue; a free block that still holds a cached
    prefix keeps its hash until it is handed out again (eviction)."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, KVBlock] = {}  # hash -> block

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def take(self, n: int) -> list[KVBlock]:
        """Hand out n free blocks, least recently freed first (evicting their cached prefix)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (free ones leave the LRU queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the LRU queue in the given order."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full, computed block findable by its hash (first writer wins)."""
        if block.block_hash is None and block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()


class BlockTableRows:
    """Every running request's block ids as one row of a persistent int32 array, written as blocks are added, so
    a step gathers its padded block tables with one indexing op instead of padding a list per request. A row past a
    request's blocks holds 0 (the padding the attention backends expect); rows and columns grow by doubling, so
    read `array` afresh after an allocation."""

    def __init__(self, rows: int = 64, width: int = 16) -> None:
        self.array = np.zeros((rows, width), dtype=np.int32)
        self._rows: dict[str, int] = {}
        self._free: list[int] = []

    def row(self, request_id: str) -> int:
        """The request's row (-1 while it holds no blocks)."""
        return self._rows.get(request_id, -1)

    def extend(self, request_id: str, start: int, block_ids: list[int]) -> None:
        """Write block_ids at columns [start, start + len) of the request's row (given one on first use)."""
        row = self._rows.get(request_id)
        if row is None:
            row = self._free.pop() if self._free else len(self._rows)
            self._rows[request_id] = row
        rows, width = self.array.shape
        end = start + len(block_ids)
        if row >= rows or end > width:
            grown = np.zeros(
                (2 * rows if row >= rows else rows, max(2 * width, end) if end > width else width),
                np.int32,
            )
            grown[:rows, :width] = self.array
            self.array = grown
        self.array[row, start:end] = block_ids

    def release(self, request_id: str, num_blocks: int) -> None:
        """Zero the request's row (its num_blocks ids) and give it back."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.array[row, :num_blocks] = 0
            self._free.append(row)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    """Block tables of running requests over one BlockPool."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}
        # the same tables as block ids, kept alongside: a step reads every running request's ids (block_ids)
        self._ids: dict[str, list[int]] = {}
        self.rows = BlockTableRows()  # and as rows of one array (a step's padded tables)
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in order. The list itself, not a copy: it grows as the request does, and a
        launched step has read what it needs from it (ModelRunner.launch) before the next allocation."""
        return self._ids.get(request_id, [])

    def has_room(self, req: Request, num_new_tokens: int) -> bool:
        """allocate_slots' short way: whether the blocks req holds already fit its computed tokens and
        num_new_tokens more (most decode steps); False leaves it to allocate_slots."""
        ids = self._ids.get(req.request_id)
        return bool(ids) and req.num_computed_tokens + num_new_tokens <= len(ids) * self.block_size

    def _extend_hashes(self, req: Request) -> None:
        """Append hashes for every full block of req's known tokens not hashed yet."""
        bs = self.block_size
        first, full = len(req.block_hashes), req.num_known_tokens // bs
        if full > first:
            req.block_hashes += chain_block_hashes(
                req.token_ids(first * bs, full * bs),
                req.mm_items,
                bs,
                first,
                req.block_hashes[-1] if first else req.hash_salt,
            )

    def prompt_digest(self, req: Request) -> bytes:
        """A digest of req's whole prompt (tokens and media): its last full block's hash chained with the
        partial block after it, hashed like a block (so it differs from every block hash); kept on the request."""
        if req.prompt_digest is None:
            bs, p = self.block_size, req.num_prompt_tokens
            full = p // bs
            if len(req.block_hashes) < full:
                self._extend_hashes(req)
            req.prompt_digest = hash_block(
                req.block_hashes[full - 1] if full else req.hash_salt,
                req.prompt_token_ids[full * bs :],
                _media_in(req.mm_items, full * bs, p),
            )
        return req.prompt_digest

    def max_hit_blocks(self, req: Request) -> int:
        """The most whole blocks a prefix hit may cover: at least one token is left to compute."""
        return (req.num_tokens - 1) // self.block_size

    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of req, in whole blocks, leaving at least one token to compute.

        Returns:
            (blocks, num_tokens): the hit blocks (not yet referenced) and the tokens they hold.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._extend_hashes(req)
        hits: list[KVBlock] = []
        for block_hash in req.block_hashes[: self.max_hit_blocks(req)]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.stats.queried_tokens += req.num_tokens
        self.stats.hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Grow req's block table to hold its computed tokens, the prefix hits and num_new_tokens more.

        Returns:
            False (and changes nothing) when the pool has too few free blocks.
        """
        table = self._tables.get(req.request_id)
        if (
            table
            and not computed_blocks
            and req.num_computed_tokens + num_new_tokens <= len(table) * self.block_size
        ):
            return True  # fits in the blocks it already holds (most decode steps)
        computed_blocks = computed_blocks or []
        table = self._tables.setdefault(req.request_id, [])
        num_tokens = (
            req.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(table) - len(computed_blocks)
        # hits that sit in the free queue stop being allocatable once we reference them
        free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free - free_hits:
            if not table:
                del self._tables[req.request_id]
            return False
        self.pool.touch(computed_blocks)
        new = computed_blocks + (self.pool.take(num_new_blocks) if num_new_blocks > 0 else [])
        table.extend(new)
        ids = self._ids.setdefault(req.request_id, [])
        ids.extend(b.block_id for b in new)
        if new:
            self.rows.extend(req.request_id, len(ids) - len(new), ids[len(ids) - len(new) :])
        # its first blocks since it was freed: the prefix hits among them count as registered
        if req.num_registered_blocks is None:
            req.num_registered_blocks = len(computed_blocks)
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register req's full blocks whose KV is now computed, so later requests can hit them."""
        done = req.num_registered_blocks or 0
        if not self.enable_prefix_caching or req.num_computed_tokens // self.block_size <= done:
            return  # no block became full since the last call (the common decode step)
        self._extend_hashes(req)
        table = self._tables.get(req.request_id, [])
        num_full = min(
            req.num_computed_tokens // self.block_size, len(req.block_hashes), len(table)
        )
        for i in range(done, num_full):
            self.pool.register(table[i], req.block_hashes[i])
        req.num_registered_blocks = max(done, num_full)

    def cache_computed_blocks_of(self, reqs: Iterable[Request]) -> None:
        """cache_computed_blocks of each of `reqs`, in order, skipping those with no newly full block (most of a
        step's) without a call each."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for req in reqs:
            if req.num_computed_tokens // bs > (req.num_registered_blocks or 0):
                self.cache_computed_blocks(req)

    def free(self, req: Request) -> None:
        """Release all of req's blocks; the tail goes first into the LRU so prefixes outlive suffixes."""
        table = self._tables.pop(req.request_id, [])
        self.rows.release(req.request_id, len(self._ids.pop(req.request_id, ())))
        req.num_registered_blocks = None
        self.pool.release(list(reversed(table)))

    def num_requests(self) -> int:
        return len(self._tables)
