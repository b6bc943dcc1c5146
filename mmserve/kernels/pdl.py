"""Programmatic dependent launch (PDL, Hopper and newer): the next kernel in the stream may start while the
current one finishes; it waits for it before touching memory.

A decode step is a chain of short kernels (batch 1: per layer an RMSNorm, four GEMVs, the fused rotary + cache
write, attention and its split-K merge, SiLU-and-mul). Without PDL each one is launched only when the one
before has finished, and its launch and ramp-up leave the GPU idle; with it, the next kernel's programs are
already resident when their inputs are ready. On an H100 a chain of 32 layers of GEMVs and norms at LLaVA-7B
shapes in a CUDA graph took 4.71 instead of 4.81 ms (scripts of 2026-11-23, docs/benchmarks.md).

Contract: every kernel launched with `pdl_options()` calls `wait_for_previous(PDL)` before its first read or
write of global memory that an earlier kernel may write or still read, so it sees everything earlier kernels
wrote and overwrites nothing they still read. Model weights are the one exception: nothing writes them during
a forward pass, and the GEMV (kernels/gemv.py) reads its first weight tile before it waits.

A kernel lets the next one launch only after its own wait, so at most two kernels of the stream are resident at
once: the one running and the one waiting for it. Letting it launch first (before the wait) chained every
waiting Triton kernel of a step onto the SMs ahead of time; where no cuBLAS GEMM broke that chain, the waiting
programs held the registers and shared memory the running kernel needed (an int8 weight-only batch-8 step: 6.79
vs 5.74 ms, H100, 2026-11-26). The weight-only GEMM (kernels/weight_only_gemm.py) releases its successor only
after its main loop (5.20 ms there); the FP8 small-M GEMM measured better releasing early (docs/benchmarks.md).
Set MMSERVE_DISABLE_PDL=1 to launch without it (to compare).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None


# The PDL constexpr of a kernel: 0 off, else when the kernel lets the next one launch (wait_for_previous).
AFTER_WAIT, AFTER_LOOP = 1, 2


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, then let the next kernel launch
    (AFTER_WAIT); AFTER_LOOP leaves that to release_dependents, later in the kernel."""
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel launch, where wait_for_previous did not (a GEMM, after its main loop)."""
    if PDL == 2:
        gdc_launch_dependents()


def pdl_options(device: torch.device, release_after_loop: bool = False) -> dict:
    """Launch keyword arguments of a kernel that calls wait_for_previous: PDL on for CUDA devices of compute
    capability 9.0 or newer, off elsewhere (older GPUs, the Triton interpreter on CPU). `release_after_loop`:
    the kernel calls release_dependents after its main loop, so the next kernel becomes resident only then."""
    if device.type != "cuda" or not _pdl_supported(
        device.index if device.index is not None else torch.cuda.current_device()
    ):
        return {"PDL": 0}
    return {"PDL": AFTER_LOOP if release_after_loop else AFTER_WAIT, "launch_pdl": True}


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if gdc_wait is None or os.environ.get("MMSERVE_DISABLE_PDL", "") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)
