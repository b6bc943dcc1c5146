"""W8A8 int8 on a GPU (kernels/int8_gemm.py through layers/w8a8_linear.py): the per-token quantization kernel equals
the torch reference bit for bit, the Triton int8 GEMM (every config) and cuBLAS's `_int_mm` with its epilogue equal
exact integer math at LLaVA-7B shapes from 1 to 512 rows, shapes `_int_mm` refuses, a given row maximum
(row-parallel ranks), and CUDA-graph replays equal to eager calls."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.w8a8_linear import int8_matmul, quantize_rows_int8, w8a8_linear
from mmserve.layers.weight_only import quantize_weight_int8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def _exact(xq, xs, wq, ws, bias=None) -> torch.Tensor:
    y = (xq.double() @ wq.double().t()) * xs.double()[:, None] * ws.double()[None, :]
    return y if bias is None else y + bias.double()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-2) -> None:
    assert (got.double() - want).abs().max().item() <= rel * want.abs().max().item()


@pytest.mark.parametrize("k", [4096, 11008, 40000])
def test_quantization_kernel_equals_the_reference(k):
    """One pass up to 32k features, two beyond; ties and a zero row; a given row maximum."""
    from mmserve.kernels.int8_gemm import quant_rows_int8

    x = torch.randn(9, k, device=CUDA, dtype=torch.bfloat16) * 4
    x[3] = 0
    x[4, :4] = torch.tensor([127.0, 0.5, -2.5, 3.5], device=CUDA)
    x[4, 4:] = x[4, 4:].clamp(-127, 127)
    for amax in (None, x.float().abs().amax(-1) * 1.5):
        q, s = quant_rows_int8(x, amax)
        rq, rs = quantize_rows_int8(x, amax)
        assert torch.equal(q, rq) and torch.equal(s, rs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 8, 16, 17, 64, 65, 512])
def test_w8a8_linear_is_exact_integer_math(m, n, k, dtype):
    wq, ws = quantize_weight_int8(torch.randn(n, k, device=CUDA) * 0.02)
    x = torch.randn(m, k, device=CUDA, dtype=dtype)
    bias = torch.randn(n, device=CUDA, dtype=dtype)
    xq, xs = quantize_rows_int8(x)
    _close(w8a8_linear(x, wq, ws, bias), _exact(xq, xs, wq, ws, bias))


def test_every_int8_gemm_config_and_int_mm_agree_with_integer_math():
    from mmserve.kernels.int8_gemm import gemm_configs, int8_gemm, int_mm_scaled

    n, k = 4096, 4096
    wq, ws = quantize_weight_int8(torch.randn(n, k, device=CUDA) * 0.02)
    for m in (1, 24, 200):
        xq, xs = quantize_rows_int8(torch.randn(m, k, device=CUDA))
        want = _exact(xq, xs, wq, ws)
        for config in gemm_configs(m):
            _close(int8_gemm(xq, xs, wq, ws, None, torch.float16, config), want, 1e-3)
        if m > 16:
            _close(int_mm_scaled(xq, xs, wq, ws, None, torch.float16), want, 1e-3)


@pytest.mark.parametrize("m", [1, 3, 40, 300])
def test_shapes_int_mm_refuses_and_a_given_row_maximum(m):
    """K and N not multiples of 8 (the Triton GEMM alone); whole_rows=False needs a process group, so the row
    maximum is given to the kernels directly."""
    from mmserve.kernels.int8_gemm import int8_gemm, quant_rows_int8

    wq, ws = quantize_weight_int8(torch.randn(100, 1001, device=CUDA) * 0.02)
    x = torch.randn(m, 1001, device=CUDA, dtype=torch.float16)
    _close(w8a8_linear(x, wq, ws), _exact(*quantize_rows_int8(x), wq, ws))
    amax = x.float().abs().amax(-1) * 2
    xq, xs = quant_rows_int8(x, amax)
    rq, rs = quantize_rows_int8(x, amax)
    got = int8_gemm(xq, xs, wq, ws, None, torch.float32)
    want = int8_matmul(rq, wq).double() * rs.double()[:, None] * ws.double()[None, :]
    _close(got, want, 1e-5)


@pytest.mark.parametrize("m", [1, 8, 300])
def test_w8a8_replays_in_a_cuda_graph(m):
    wq, ws = quantize_weight_int8(torch.randn(4096, 4096, device=CUDA) * 0.02)
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
    w8a8_linear(x, wq, ws)  # autotune / time before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a8_linear(x, wq, ws)
    x.copy_(torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(y, w8a8_linear(x, wq, ws), atol=0, rtol=0)
