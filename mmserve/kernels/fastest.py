"""Per-shape choice between interchangeable kernels (same math, different speed), by timing each once.

Timing needs real launches, so it happens on the first eager call of a shape; the decode CUDA graphs warm
up every batch size before they capture. A call inside a capture with no choice made yet gets the first
candidate. Candidates are timed in interleaved rounds and each keeps its best median, so one noisy
measurement (another process, a clock change) cannot pick a kernel that is slower in the steady state.

`bench_ms` is the timer, also given to the Triton autotuners of kernels/gemv.py and kernels/fp8_gemm.py. It
times a candidate the way the decode step runs it: inside a CUDA graph (no Python launch cost between
kernels), each call after an L2 flush that *reads* a buffer larger than L2. triton's `do_bench` differs on
both counts and both biased the choice at batch 1: its flush zeroes a buffer, leaving L2 full of dirty lines
that the timed kernel pays to write back, and it launches each timed call from Python, so a kernel with a
slow launcher (Triton's) is timed with the GPU waiting for it. For o_proj (4096 x 4096) it timed cuBLAS
faster than the GEMV (23.3 vs 26.4 us) that is faster in the decode graph (~11.5 vs 15.8 us).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence

import torch

from mmserve.kernels.graph_capture import graph_capture

_CHOICE: dict[Hashable, int] = {}
TIMINGS: dict[Hashable, list[float]] = {}  # ms per candidate, as measured when the choice was made
ROUNDS = 3
_FLUSH_BYTES = 256 << 20  # > L2 of any current GPU (H100: 50 MB)
_flush_buffers: dict[torch.device, torch.Tensor] = {}


def _flush_l2(device: torch.device) -> None:
    """Evict the L2 cache by reading (not writing) a buffer larger than it: the lines left behind are clean."""
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = _flush_buffers[device] = torch.ones(
            _FLUSH_BYTES // 4, dtype=torch.float32, device=device
        )
        buf.sum()  # the fill's dirty lines are written back here, not in a timed call
    buf.amax()


def bench_ms(
    fn: Callable[[], object],
    quantiles: Sequence[float] | None = None,
    reps: int = 16,
    replays: int = 7,
) -> float | list[float]:
    """GPU time of one call of `fn` in ms: the median (or the given quantiles, as triton's autotuner asks) over
    replays of a graph of `reps` x (L2 flush, fn), less the same graph without fn. `fn` must be capturable."""
    device = torch.device("cuda", torch.cuda.current_device())
    _flush_l2(device)
    fn()  # compile / pick kernels outside the capture
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle()
    with_fn, flush_only = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    # "thread_local": a server's preprocessing threads may use the GPU meanwhile (see encoder_graphs.py)
    with graph_capture(with_fn, pool, capture_error_mode="thread_local"):
        for _ in range(reps):
            _flush_l2(device)
            fn()
    with graph_capture(flush_only, pool, capture_error_mode="thread_local"):
        for _ in range(reps):
            _flush_l2(device)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(replays)]
    with_fn.replay()  # first replays upload the graphs
    flush_only.replay()
    for ev in events:  # interleaved, so a clock change hits both alike
        ev[0].record()
        with_fn.replay()
        ev[1].record()
        flush_only.replay()
        ev[2].record()
    torch.cuda.synchronize(device)
    per_call = sorted(
        max(0.0, (a.elapsed_time(b) - b.elapsed_time(c)) / reps) for a, b, c in events
    )
    if quantiles is None:
        return statistics.median(per_call)
    return [per_call[min(len(per_call) - 1, int(q * len(per_call)))] for q in quantiles]


def run_fastest(key: Hashable, candidates: Sequence[Callable[[], torch.Tensor]]) -> torch.Tensor:
    """Run whichever candidate was fastest for `key` (timed now if this key is new)."""
    choice = _CHOICE.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return candidates[0]()
        times = [
            min(ts) for ts in zip(*([bench_ms(fn) for fn in candidates] for _ in range(ROUNDS)))
        ]
        TIMINGS[key] = times
        choice = _CHOICE[key] = min(range(len(times)), key=times.__getitem__)
    return candidates[choice]()
