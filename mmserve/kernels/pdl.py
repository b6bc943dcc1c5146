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
except ImportError:   # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Let the next kernel launch, then wait until the previous kernel has finished and its writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


def pdl_options(device: torch.device) -> dict:
    """Launch keyword arguments of a kernel that calls wait_for_previous: PDL on for CUDA devices of compute
    capability 9.0 or newer, off elsewhere (older GPUs, the Triton interpreter on CPU)."""
    if device.type != "cuda" or not _pdl_supported(device.index if device.index is not None
                                                   else torch.cuda.current_device()):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if gdc_wait is None or os.environ.get("MMSERVE_DISABLE_PDL", "") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)
