"""How every CUDA graph in mmserve is captured (decode, prefill, piecewise and vision-encoder graphs in
worker/, the kernel timer in kernels/fastest.py): with Python's garbage collector paused."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's garbage collector off: a collection during a capture could free another engine's CUDA
    graphs, and destroying a graph is not allowed while a stream captures."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def graph_capture(
    graph: torch.cuda.CUDAGraph, pool, capture_error_mode: str = "global"
) -> Iterator[None]:
    """torch.cuda.graph with Python's garbage collector paused (gc_paused)."""
    with gc_paused(), torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
        yield
