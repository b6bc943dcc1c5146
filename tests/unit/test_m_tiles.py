"""The small-M GEMMs' row buckets (kernels/m_tiles.py): a call's M picks the configs of its BLOCK_M, and a kernel
without that bucket (the FP8 small-M GEMM taking more rows where cuBLASLt cannot) keeps its widest tiles."""

from __future__ import annotations

import pytest
import triton

from mmserve.kernels.m_tiles import SMALL_M, m_tile, prune_m_tiles


def _configs(*block_ms):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": 64}) for bm in block_ms]


@pytest.mark.parametrize(
    "m,want", [(1, 16), (16, 16), (17, 32), (33, 64), (SMALL_M, 64), (SMALL_M + 1, 128)]
)
def test_m_tile_buckets(m, want):
    assert m_tile(m) == want


def test_prune_keeps_the_bucket_or_the_widest_tiles():
    both = _configs(16, 32, 64, 128)
    assert [c.kwargs["BLOCK_M"] for c in prune_m_tiles(both, {"M": 20})] == [32]
    assert [c.kwargs["BLOCK_M"] for c in prune_m_tiles(both, {"M": 300})] == [128]
    small_only = _configs(16, 32, 64, 64)
    assert [c.kwargs["BLOCK_M"] for c in prune_m_tiles(small_only, {"M": 300})] == [64, 64]
    assert [c.kwargs["BLOCK_M"] for c in prune_m_tiles(small_only, {"M": 3})] == [16]
