"""kernels/fastest.py on a GPU: the L2-flushing timer orders work by its length and the per-key choice keeps
the faster candidate, records the timings and is made once per key."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def _spin(cycles: int) -> torch.Tensor:
    torch.cuda._sleep(cycles)
    return torch.full((1,), cycles, device="cuda")


def test_bench_ms_orders_by_work_and_returns_quantiles():
    from mmserve.kernels.fastest import bench_ms

    short, long = bench_ms(lambda: _spin(20_000)), bench_ms(lambda: _spin(2_000_000))
    assert 0 < short < long
    lo, mid, hi = bench_ms(lambda: _spin(200_000), quantiles=(0.2, 0.5, 0.8))
    assert 0 < lo <= mid <= hi


def test_run_fastest_keeps_the_faster_candidate_once_per_key():
    from mmserve.kernels import fastest

    calls = []

    def candidate(cycles):
        def run():
            calls.append(cycles)
            return _spin(cycles)

        return run

    key = ("test_fastest", id(calls))
    out = fastest.run_fastest(key, [candidate(2_000_000), candidate(20_000)])
    assert out.item() == 20_000
    slow, fast = fastest.TIMINGS[key]
    assert fast < slow
    calls.clear()
    fastest.run_fastest(key, [candidate(2_000_000), candidate(20_000)])
    assert calls == [20_000]  # chosen once; no more timing
