"""The row buckets the small-M Triton GEMMs autotune over: each call's M rounds up to a BLOCK_M of 16, 32 or 64 (one
tile of rows: batched decode, weight-read bound), past SMALL_M rows to 128 (prompts, compute-bound), and a kernel's
autotuner keys on that bucket and keeps only the configs of its BLOCK_M."""

from __future__ import annotations

import triton

SMALL_M = 64


def m_tile(m: int) -> int:
    """The autotuning bucket of M rows: 16, 32 or 64 (the small-M tiles' BLOCK_M), else 128."""
    return min(max(16, triton.next_power_of_2(m)), SMALL_M) if m <= SMALL_M else 128


def prune_m_tiles(configs, named_args, **kwargs):
    """Triton's early config prune: the configs whose BLOCK_M is the call's bucket of M, or the widest BLOCK_M a
    kernel has when it has none of that bucket (a small-M kernel taking more rows, which it tiles)."""
    bm = min(m_tile(named_args["M"]), max(c.kwargs["BLOCK_M"] for c in configs))
    return [c for c in configs if c.kwargs["BLOCK_M"] == bm]
