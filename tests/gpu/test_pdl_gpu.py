"""Programmatic dependent launch (kernels/pdl.py): on a Hopper GPU our kernels launch with it, and a CUDA graph of
dependent kernels (each reading what the one before wrote) gives the same bits with it as without it. A kernel
that read its input before waiting for the previous one, or let the next one launch before its own wait or main
loop and then wrote what that one reads, would show stale data here. The chain's linears are the three Triton
matmuls of decode steps: the one-row GEMV (batch 1), the weight-only GEMM (releases its successor after its main
loop) and the FP8 small-M GEMM, at 8 rows."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import pdl
from mmserve.kernels.fp8_gemm import fp8_gemm_small_m, quant_rows
from mmserve.kernels.fused_ops import rms_norm, silu_and_mul
from mmserve.kernels.gemv import gemv
from mmserve.kernels.weight_only_gemm import weight_only_gemm
from mmserve.layers.fp8_linear import quantize_weight
from mmserve.layers.weight_only import quantize_weight_int8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gemv_linear(w: torch.Tensor):
    return lambda x: gemv(x, w)


def _int8_linear(w: torch.Tensor):
    q, s = quantize_weight_int8(w)
    return lambda x: weight_only_gemm(x, q, s, None)


def _fp8_linear(w: torch.Tensor):
    q, s = quantize_weight(w)
    return lambda x: fp8_gemm_small_m(*quant_rows(x), q, s, None, x.dtype)


LINEARS = {"gemv": (_gemv_linear, 1), "int8_gemm": (_int8_linear, 8), "fp8_gemm": (_fp8_linear, 8)}


def _chain(x: torch.Tensor, norm_w: torch.Tensor, up, down) -> torch.Tensor:
    """16 layers of norm -> linear -> SiLU-and-mul -> linear, each launch consuming the previous one's output."""
    for _ in range(16):
        h = rms_norm(x, norm_w, 1e-6)
        x = down(silu_and_mul(up(h))) + x
    return x


def _in_graph(x, *weights) -> torch.Tensor:
    _chain(x, *weights)  # compile and autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, *weights)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@pytest.mark.parametrize("linear", sorted(LINEARS))
def test_dependent_kernels_give_the_same_bits_with_and_without_pdl(
    monkeypatch, linear: str
) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden, inter = 4096, 11008
    make_linear, rows = LINEARS[linear]
    x = torch.randn(rows, hidden, device=dev, generator=gen, dtype=torch.float16)
    weights = (
        torch.rand(hidden, device=dev, generator=gen, dtype=torch.float16) + 0.5,
        make_linear(
            torch.randn(2 * inter, hidden, device=dev, generator=gen, dtype=torch.float16)
            * hidden**-0.5
        ),
        make_linear(
            torch.randn(hidden, inter, device=dev, generator=gen, dtype=torch.float16) * inter**-0.5
        ),
    )
    with_pdl = _in_graph(x, *weights)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert pdl.pdl_options(dev)["PDL"] == (pdl.AFTER_WAIT if hopper else 0)
    assert pdl.pdl_options(dev, release_after_loop=True)["PDL"] == (pdl.AFTER_LOOP if hopper else 0)

    monkeypatch.setenv("MMSERVE_DISABLE_PDL", "1")
    pdl._pdl_supported.cache_clear()
    try:
        assert pdl.pdl_options(dev) == {"PDL": 0}
        without = _in_graph(x, *weights)
    finally:
        monkeypatch.delenv("MMSERVE_DISABLE_PDL")
        pdl._pdl_supported.cache_clear()
    assert torch.isfinite(without).all()
    assert torch.equal(with_pdl, without)
