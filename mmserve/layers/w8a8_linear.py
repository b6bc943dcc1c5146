"""W8A8 int8 linear math (compressed-tensors "int-quantized" checkpoints, `--quantization w8a8`): an int8 weight
q_w [N, K] with one fp32 scale per output row s_w, activations quantized per token at run time (dynamic,
symmetric: s_x[m] = max_k |x[m, k]| / 127, q_x = round(x / s_x) in -127..127), and

    y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k]   (+ bias[n]),

the sum in int32: exact, in any order. On CUDA the sum is cuBLAS's int8 GEMM (`torch._int_mm`, which wants more than
16 rows and K, N multiples of 8: fewer rows are padded to 17, other K / N go through float64, exact for these
sums); the CPU runs `torch._int_mm` too, so both compute the same integers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
_INT_MM_MIN_ROWS = 17


def quantize_rows_int8(
    x: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 scale [M]): each row scaled so its largest magnitude (`amax` [M] when given: a row-parallel
    rank's slice of longer rows) maps to 127 (a zero row: scale 1e-12 / 127, values 0)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) if amax is None else amax).clamp(min=1e-12) / INT8_MAX
    return torch.round(xf / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = a [M, K] int8 @ b [N, K]^T int8, exactly."""
    m, k = a.shape
    n = b.shape[0]
    if k % 8 or n % 8:
        return (a.double() @ b.double().t()).to(torch.int32)  # |sum| < 127^2 K < 2^53: exact
    if a.is_cuda and m < _INT_MM_MIN_ROWS:
        return torch._int_mm(F.pad(a, (0, 0, 0, _INT_MM_MIN_ROWS - m)), b.t())[:m]
    return torch._int_mm(a, b.t())


def w8a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    whole_rows: bool = True,
) -> torch.Tensor:
    """y = (formula above) in x's dtype; x [..., K], weight int8 [N, K], weight_scale fp32 [N]. `whole_rows` False:
    x holds this tensor-parallel rank's slice of each row, scaled by the whole row's maximum (a max over the ranks,
    so every rank quantizes its slice as one process quantizes the row)."""
    x2 = x.reshape(-1, x.shape[-1])
    amax = None
    if not whole_rows:
        from mmserve.distributed import tp_all_reduce

        amax = tp_all_reduce(x2.float().abs().amax(dim=-1), op="max")
    xq, xs = quantize_rows_int8(x2, amax)
    acc = int8_matmul(xq, weight)
    y = acc.float() * xs[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
