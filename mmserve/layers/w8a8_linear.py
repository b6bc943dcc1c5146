"""W8A8 int8 linear math (compressed-tensors "int-quantized" checkpoints, `--quantization w8a8`): an int8 weight
q_w [N, K] with one fp32 scale per output row s_w, activations quantized per token at run time (dynamic,
symmetric: s_x[m] = max_k |x[m, k]| / 127, q_x = round(x / s_x) in -127..127), and

    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k]   (+ bias[n]),

the sum in int32: exact, in any order. On CUDA (kernels/int8_gemm.py) one Triton launch quantizes the activations
and, up to SMALL_M rows (decode), a Triton int8 tensor-core GEMM applies both scales and the bias in its epilogue
(one row: that or kernels/gemv.py's GEMV, whichever was timed faster; its fp32 sums of int8 products are exact up
to 2^24 per partial sum, within a few ulps past it); more rows take whichever of that GEMM and cuBLAS's int8 GEMM
(`torch._int_mm`) plus one epilogue kernel was timed faster for the shape (kernels/fastest.py). The CPU runs the
torch reference below (`torch._int_mm` where K and N are multiples of 8, else float64, exact for these sums), so
both compute the same integers. A norm or activation feeding the layer may hand it its rows already quantized
(kernels/fused_ops.py's `rows_dtype=torch.int8`: QuantizedRows, the same bits), and the layer skips quantizing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.kernels.fp8_format import QuantizedRows

INT8_MAX = 127.0
_INT_MM_MIN_ROWS = 17


def quantize_rows_int8(
    x: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 scale [M]): each row scaled so its largest magnitude (`amax` [M] when given: a row-parallel
    rank's slice of longer rows) maps to 127 (a zero row: scale 1e-12 / 127, values 0)."""
    xf = x.float()
    amax = (xf.abs().amax(dim=-1) if amax is None else amax).clamp(min=1e-12)
    # a tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal (not IEEE), and the
    # Triton kernel (kernels/int8_gemm.py) divides exactly, on every device
    scale = amax / torch.full_like(amax, INT8_MAX)
    return torch.round(xf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = a [M, K] int8 @ b [N, K]^T int8, exactly."""
    m, k = a.shape
    n = b.shape[0]
    if k % 8 or n % 8:
        return (a.double() @ b.double().t()).to(torch.int32)  # |sum| < 127^2 K < 2^53: exact
    # a reference on CUDA too (tests); w8a8_linear's CUDA path has no padding
    if a.is_cuda and m < _INT_MM_MIN_ROWS:
        return torch._int_mm(F.pad(a, (0, 0, 0, _INT_MM_MIN_ROWS - m)), b.t())[:m]
    return torch._int_mm(a, b.t())


def _cuda_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The Triton / cuBLAS path of `w8a8_linear` for quantized rows xq [M, K], xs [M] on a GPU."""
    from mmserve.kernels.fastest import run_fastest
    from mmserve.kernels.gemv import gemv
    from mmserve.kernels.int8_gemm import int8_gemm, int_mm_scaled
    from mmserve.kernels.m_tiles import SMALL_M
    from mmserve.layers.weight_only import rows_bucket

    args = (xq, xs, weight, weight_scale.float(), bias, dtype)
    m, (n, k) = len(xq), weight.shape
    if (
        m == 1
    ):  # kernels/gemv.py's one-row GEMV over int8 operands (fp32 sums) or the GEMM's 16-row tiles
        key = ("w8a8_one_row", (n, k), bias is not None, dtype, xq.device)
        return run_fastest(
            key, [lambda: int8_gemm(*args), lambda: gemv(xq, weight, bias, xs, args[3], dtype)]
        )
    if m <= SMALL_M or k % 8 or n % 8:  # SMALL_M >= 16: more rows suit torch._int_mm
        return int8_gemm(*args)
    key = ("w8a8_linear", (n, k), bias is not None, dtype, rows_bucket(m), xq.device)
    return run_fastest(key, [lambda: int8_gemm(*args), lambda: int_mm_scaled(*args)])


def _quantize(x2: torch.Tensor, whole_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K]'s int8 rows and scales: the Triton kernel on a GPU, the reference elsewhere (the same bits)."""
    amax = None
    if not whole_rows:
        from mmserve.distributed import tp_all_reduce

        amax = tp_all_reduce(x2.float().abs().amax(dim=-1), op="max")
    if x2.is_cuda:
        from mmserve.kernels.int8_gemm import quant_rows_int8

        return quant_rows_int8(x2 if x2.stride(-1) == 1 else x2.contiguous(), amax)
    return quantize_rows_int8(x2, amax)


def w8a8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    whole_rows: bool = True,
) -> torch.Tensor:
    """y = (formula above) in x's dtype; x [..., K] or int8 rows [M, K] a producer quantized already (whole rows
    only), weight int8 [N, K], weight_scale fp32 [N]. `whole_rows` False: x holds this tensor-parallel rank's slice
    of each row, scaled by the whole row's maximum (a max over the ranks, so every rank quantizes its slice as one
    process quantizes the row)."""
    if isinstance(x, QuantizedRows):
        assert whole_rows and x.q.dtype == torch.int8, "int8 rows come quantized over whole rows"
        (xq, xs, dtype), lead = x, x.q.shape[:-1]
    else:
        dtype, lead = x.dtype, x.shape[:-1]
        xq, xs = _quantize(x.reshape(-1, x.shape[-1]), whole_rows)
    if xq.is_cuda:
        y = _cuda_matmul(xq, xs, weight, weight_scale, bias, dtype)
    else:
        y = int8_matmul(xq, weight).float() * xs[:, None] * weight_scale.float()[None, :]
        if bias is not None:
            y = y + bias.float()
    return y.to(dtype).reshape(*lead, weight.shape[0])
