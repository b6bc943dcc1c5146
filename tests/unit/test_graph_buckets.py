"""Token buckets of the prefill and piecewise CUDA graphs: every step size up to the budget has one, padding stays
bounded, and budgets past 2048 tokens get graphs too."""

from __future__ import annotations

import bisect

import pytest

from mmserve.worker.prefill_graphs import TOKEN_BUCKETS, token_buckets


@pytest.mark.parametrize("budget", [16, 100, 2048, 3000, 4096, 8192, 20000])
def test_every_step_size_up_to_the_budget_has_a_bucket(budget):
    buckets = token_buckets(budget)
    assert buckets == sorted(set(buckets))
    assert buckets[-1] == min(budget, TOKEN_BUCKETS[-1])
    for n in range(1, buckets[-1] + 1):
        b = buckets[bisect.bisect_left(buckets, n)]
        assert n <= b
        if n > 64:  # above the small buckets a chunk is padded by less than half its size
            assert b < n * 1.5, (n, b)
