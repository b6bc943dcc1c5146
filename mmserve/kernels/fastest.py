"""Per-shape choice between interchangeable kernels (same math, different speed), by timing each once.

Timing needs real launches, so it happens on the first eager call of a shape; the decode CUDA graphs warm
up every batch size before they capture. A call inside a capture with no choice made yet gets the first
candidate. Candidates are timed in interleaved rounds and each keeps its best median, so one noisy
measurement (another process, a clock change) cannot pick a kernel that is slower in the steady state.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
import triton.testing

_CHOICE: dict[Hashable, int] = {}
TIMINGS: dict[Hashable, list[float]] = {}   # ms per candidate, as measured when the choice was made
ROUNDS = 3


def run_fastest(key: Hashable, candidates: Sequence[Callable[[], torch.Tensor]]) -> torch.Tensor:
    """Run whichever candidate was fastest for `key` (timed now if this key is new)."""
    choice = _CHOICE.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return candidates[0]()
        times = [min(ts) for ts in zip(*(
            [triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") for fn in candidates]
            for _ in range(ROUNDS)))]
        TIMINGS[key] = times
        choice = _CHOICE[key] = min(range(len(times)), key=times.__getitem__)
    return candidates[choice]()
