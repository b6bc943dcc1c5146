"""Programmatic dependent launch (kernels/pdl.py): on a Hopper GPU our kernels launch with it, and a CUDA graph of
dependent kernels (each reading what the one before wrote) gives the same bits with it as without it. A kernel
that read its input before waiting for the previous one would read stale data here."""
from __future__ import annotations

import pytest
import torch

from mmserve.kernels import pdl
from mmserve.kernels.fused_ops import rms_norm, silu_and_mul
from mmserve.kernels.gemv import gemv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _chain(x: torch.Tensor, norm_w: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """16 layers of norm -> GEMV -> SiLU-and-mul -> GEMV, each launch consuming the previous one's output."""
    for _ in range(16):
        h = rms_norm(x, norm_w, 1e-6)
        x = gemv(silu_and_mul(gemv(h, w_up)), w_down) + x
    return x


def _in_graph(x, *weights) -> torch.Tensor:
    _chain(x, *weights)   # compile and autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, *weights)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def test_dependent_kernels_give_the_same_bits_with_and_without_pdl(monkeypatch) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden, inter = 4096, 11008
    x = torch.randn(1, hidden, device=dev, generator=gen, dtype=torch.float16)
    weights = (torch.rand(hidden, device=dev, generator=gen, dtype=torch.float16) + 0.5,
               torch.randn(2 * inter, hidden, device=dev, generator=gen, dtype=torch.float16) * hidden ** -0.5,
               torch.randn(hidden, inter, device=dev, generator=gen, dtype=torch.float16) * inter ** -0.5)
    with_pdl = _in_graph(x, *weights)
    assert pdl.pdl_options(dev)["PDL"] == (torch.cuda.get_device_capability() >= (9, 0))

    monkeypatch.setenv("MMSERVE_DISABLE_PDL", "1")
    pdl._pdl_supported.cache_clear()
    try:
        assert pdl.pdl_options(dev) == {"PDL": False}
        without = _in_graph(x, *weights)
    finally:
        monkeypatch.delenv("MMSERVE_DISABLE_PDL")
        pdl._pdl_supported.cache_clear()
    assert torch.isfinite(without).all()
    assert torch.equal(with_pdl, without)
