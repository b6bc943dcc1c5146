"""Weight-only linear (int8 and packed int4) on a GPU at LLaVA-7B shapes: the one-row GEMVs over the stored rows
and the dequantizing path for more rows against the fp32 formula, and a CUDA-graph replay equal to an eager call."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.weight_only import (
    dequantize,
    quantize_weight_int4,
    quantize_weight_int8,
    weight_only_linear,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
QUANTIZE = {"int8": quantize_weight_int8, "int4": quantize_weight_int4}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 7, 300])
def test_weight_only_linear_matches_the_formula(
    m: int, n: int, k: int, method: str, dtype: torch.dtype
) -> None:
    """Every path: the GEMVs (one row), the small-M GEMM (7), the large-M choice (300) in fp16 and bf16."""
    g = torch.Generator(device=CUDA).manual_seed(m + n)
    w, s = QUANTIZE[method](torch.randn(n, k, device=CUDA, generator=g) * 0.02)
    x = torch.randn(m, k, device=CUDA, generator=g, dtype=dtype)
    bias = torch.randn(n, device=CUDA, generator=g, dtype=dtype)
    want = x.float() @ dequantize(w, s, torch.float32).t() + bias.float()
    got = weight_only_linear(x, w, s, bias).float()
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    if m > 1:  # the Triton GEMM alone too, whichever path the large-M timing chose
        from mmserve.kernels.weight_only_gemm import weight_only_gemm

        alone = weight_only_gemm(x, w, s, bias).float()
        assert (alone - want).abs().max().item() <= 1e-2 * want.abs().max().item()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_weight_only_gemv_replays_in_a_cuda_graph(method: str) -> None:
    w, s = QUANTIZE[method](torch.randn(4096, 4096, device=CUDA) * 0.02)
    x = torch.randn(1, 4096, device=CUDA, dtype=torch.float16)
    weight_only_linear(x, w, s)  # autotune before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = weight_only_linear(x, w, s)
    x.copy_(torch.randn(1, 4096, device=CUDA, dtype=torch.float16))
    graph.replay()
    torch.testing.assert_close(y, weight_only_linear(x, w, s), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008), (4096, 2048)])
@pytest.mark.parametrize("m", [2, 7, 33, 64])
def test_small_m_gemm_over_float_weights_matches_cublas(
    m: int, n: int, k: int, dtype: torch.dtype
) -> None:
    """The fp16 / bf16 small-M GEMM (layers/linear.py's candidate for batched decode) against cuBLAS, and `linear`
    whichever it chose, replayed from a CUDA graph equal to an eager call."""
    from mmserve.kernels.weight_only_gemm import small_m_gemm
    from mmserve.layers.linear import linear

    g = torch.Generator(device=CUDA).manual_seed(m + n + k)
    w = (torch.randn(n, k, device=CUDA, generator=g) * 0.02).to(dtype)
    x = torch.randn(m, k, device=CUDA, generator=g, dtype=dtype)
    bias = torch.randn(n, device=CUDA, generator=g, dtype=dtype)
    want = x.float() @ w.float().t() + bias.float()
    for got in (small_m_gemm(x, w, bias), linear(x, w, bias)):
        assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = linear(x, w, bias)
    x.copy_(torch.randn(m, k, device=CUDA, generator=g, dtype=dtype))
    graph.replay()
    torch.testing.assert_close(y, linear(x, w, bias), atol=0, rtol=0)
