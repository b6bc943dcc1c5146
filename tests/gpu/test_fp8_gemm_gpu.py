"""FP8 W8A8 kernels vs the torch reference (layers/fp8_linear.py) at LLaVA-7B shapes on a GPU with FP8
tensor cores: row quantization bit for bit, the one-row GEMV and small-M Triton GEMM within fp16 rounding,
cuBLASLt's fast accumulation within a small fraction of the quantization's own error (fp32 outputs: full
accumulation), and a CUDA-graph replay equal to an eager call."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.fp8_linear import (
    fp8_linear_reference,
    fp8_supported,
    quantize_rows,
    quantize_weight,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
SHAPES = [(12288, 4096), (4096, 11008)]  # qkv_proj, down_proj


def _needs_fp8() -> None:
    if not fp8_supported(CUDA):
        pytest.skip("FP8 tensor cores need compute capability >= 8.9")


@pytest.mark.parametrize("k", [4096, 11008, 40000])  # one pass up to 32k features, looped beyond
def test_quant_rows_is_bit_exact(k: int) -> None:
    from mmserve.kernels.fp8_gemm import quant_rows

    _needs_fp8()
    g = torch.Generator(device=CUDA).manual_seed(k)
    x = torch.randn(300, k, device=CUDA, generator=g, dtype=torch.float16) * 4
    x[7] = 0
    for static in (None, torch.tensor([0.01], device=CUDA)):
        q, s = quant_rows(x, static)
        want_q, want_s = quantize_rows(x, static)
        assert torch.equal(s, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 64, 65, 700])
def test_fp8_matmul_matches_reference(m: int, n: int, k: int) -> None:
    from mmserve.kernels.fp8_gemm import SMALL_M, fp8_gemm_small_m, fp8_gemv, fp8_matmul, quant_rows

    _needs_fp8()
    g = torch.Generator(device=CUDA).manual_seed(m * 7 + n)
    w, ws = quantize_weight(torch.randn(n, k, device=CUDA, generator=g) * 0.02)
    x = torch.randn(m, k, device=CUDA, generator=g, dtype=torch.float16)
    bias = torch.randn(n, device=CUDA, generator=g, dtype=torch.float16)
    for static in (None, torch.tensor([3.0 / 448], device=CUDA)):
        want = fp8_linear_reference(x, w, ws, static, bias).float()
        scale = want.abs().max().item()
        got = fp8_matmul(x, w, ws, static, bias).float()
        # past SMALL_M rows cuBLASLt accumulates fast (kernels/fp8_gemm.py): its error stays under a tenth of
        # what quantizing to e4m3 costs against the unquantized product
        tol = 4e-3 if m <= SMALL_M else 1.5e-2
        assert (got - want).abs().max().item() <= tol * scale, (
            f"fp8_matmul M={m} static={static is not None}"
        )
        if m > SMALL_M:
            unquantized = x.double() @ (w.double() * ws.double()[:, None]).t() + bias.double()
            quant_err = (want.double() - unquantized).norm().item()
            assert (got.double() - want.double()).norm().item() <= 0.1 * quant_err, (
                f"fast accumulation M={m}"
            )
        if m == 1:  # both one-row candidates, whichever the timing picked
            xq, xs = quant_rows(x, static)
            for path in (fp8_gemv, fp8_gemm_small_m):
                got = path(xq, xs, w, ws, bias, x.dtype).float()
                assert (got - want).abs().max().item() <= 4e-3 * scale, path.__name__


@pytest.mark.parametrize("m", [8, 128])
def test_fp8_matmul_replays_in_a_cuda_graph(m: int) -> None:
    from mmserve.kernels.fp8_gemm import fp8_matmul

    _needs_fp8()
    n, k = SHAPES[0]
    w, ws = quantize_weight(torch.randn(n, k, device=CUDA) * 0.02)
    x = torch.randn(m, k, device=CUDA, dtype=torch.float16)
    fp8_matmul(x, w, ws, None, None)  # autotune / pick before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_matmul(x, w, ws, None, None)
    x.copy_(torch.randn(m, k, device=CUDA, dtype=torch.float16))
    graph.replay()
    torch.testing.assert_close(y, fp8_matmul(x, w, ws, None, None), atol=0, rtol=0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n,k", [(240, 80), (80, 80), (272, 80), (80, 136)]
)  # a tiny test model's layers
def test_fp8_matmul_small_shapes_every_dtype(n: int, k: int, out_dtype: torch.dtype) -> None:
    from mmserve.kernels.fp8_gemm import fp8_matmul

    _needs_fp8()
    g = torch.Generator(device=CUDA).manual_seed(n + k)
    w, ws = quantize_weight(torch.randn(n, k, device=CUDA, generator=g) * 0.1)
    for m in (1, 5, 64, 65, 300):
        x = torch.randn(m, k, device=CUDA, generator=g).to(out_dtype)
        for bias in (None, torch.randn(n, device=CUDA, generator=g).to(out_dtype)):
            for static in (None, torch.tensor([2.0 / 448], device=CUDA)):
                want = fp8_linear_reference(x, w, ws, static, bias).float()
                got = fp8_matmul(x, w, ws, static, bias).float()
                # Hopper's FP8 tensor cores keep ~14 mantissa bits per partial sum: ~1e-4 even for fp32 outputs
                tol = 5e-4 if out_dtype == torch.float32 else 1e-2
                err = (got - want).abs().max().item() / want.abs().max().item()
                what = (
                    f"M={m} {n}x{k} {out_dtype} bias={bias is not None} static={static is not None}"
                )
                assert err <= tol, f"{what}: relative error {err:.2e}"
