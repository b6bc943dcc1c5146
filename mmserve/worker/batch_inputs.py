"""Host-side layout of one step's flat inputs: KV cache slots of each request's chunk, the leading decodes of a
mixed batch, and rotary positions (plain or M-RoPE) concatenated over the batch."""
from __future__ import annotations

import numpy as np
import torch

from mmserve.worker.transfer import host_tensor


def slot_ids(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV cache slots of a sequence's token positions [start, end), given its block table: one range per
    block instead of one Python expression per token (a 2048-token chunk is 128 ranges)."""
    out: list[int] = []
    for i in range(start // block_size, (end - 1) // block_size + 1):
        base = block_ids[i] * block_size
        out += range(base + max(start - i * block_size, 0), base + min(end - i * block_size, block_size))
    return out


def num_leading_decodes(query_start_loc: list[int]) -> int:
    """How many sequences at the front of the batch have exactly one query token."""
    n = 0
    while n + 1 < len(query_start_loc) and query_start_loc[n + 1] - query_start_loc[n] == 1:
        n += 1
    return n


def cat_positions(parts: list, mrope: bool) -> torch.Tensor:
    """Per-request positions (ranges; for M-RoPE ranges meaning all three axes, or [3, n] tensors) -> [T], or
    [3, T] for M-RoPE, int64 on the host."""
    if not mrope:
        return host_tensor([p for r in parts for p in r], torch.int64)
    out = np.empty((3, sum(len(r) if isinstance(r, range) else r.shape[1] for r in parts)), dtype=np.int64)
    i = 0
    for r in parts:
        n = len(r) if isinstance(r, range) else r.shape[1]
        if isinstance(r, torch.Tensor):
            out[:, i:i + n] = r.numpy()
        elif n == 1:   # a decode: one column
            out[:, i] = r.start
        else:
            out[:, i:i + n] = np.arange(r.start, r.stop)
        i += n
    return torch.from_numpy(out)
