"""Weight-only linear math (`--quantization int8 | int4`, TensorRT-LLM's `--use_weight_only
--weight_only_precision int8 | int4`): weights stored as 8- or 4-bit integers with one fp32 scale per output row,
activations in the model's dtype.

A weight W [N, K] is stored as q = round(W / s) clamped to [-Q, Q] with s[n] = max|W[n]| / Q (Q = 127 for int8,
7 for int4), and

    y[m, n] = s[n] * sum_k x[m, k] * q[n, k]   (+ bias[n]),

summed in fp32. int8 keeps q as int8 [N, K]; int4 packs two values per byte, uint8 [N, K / 2] (q[2i] in the low
nibble, q[2i + 1] in the high one, two's complement). Half / a quarter of the weight memory and reads of fp16. On
CUDA a one-row activation (batch-1 decode, where a step is a stream of weight reads) goes through a Triton GEMV
over the stored rows (kernels/gemv.py, the scale applied after the sum), up to 64 rows (batched decode) through a
Triton tensor-core GEMM over them (kernels/weight_only_gemm.py). More rows (prompts, compute-bound) go through that
GEMM with prompt-sized tiles (the weights turned into the activations' dtype in registers) or through cuBLAS on a
copy dequantized for the call, whichever was timed faster for the shape (kernels/fastest.py). The CPU computes the formula above in the activations'
dtype (fp32 on the CPU: exact up to summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127.0
INT4_MAX = 7.0


def quantize_weight_int8(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], fp32 scale [N]): each output row scaled so its largest magnitude (`amax` [N] when
    given: a row-parallel shard's rows are part of longer ones) maps to 127."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) if amax is None else amax).clamp(min=1e-12) / INT8_MAX
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_weight_int4(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 weight [N, K / 2], fp32 scale [N]): each output row scaled so its largest magnitude (`amax`
    as for int8) maps to 7; K must be even."""
    if weight.shape[1] % 2:
        raise ValueError(
            f"int4 weights pack two values per byte: in_features {weight.shape[1]} must be even"
        )
    w = weight.float()
    scale = (w.abs().amax(dim=1) if amax is None else amax).clamp(min=1e-12) / INT4_MAX
    q = torch.round(w / scale[:, None]).clamp(-INT4_MAX, INT4_MAX).to(torch.int16)
    nibbles = q & 0xF  # two's complement in 4 bits
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).to(torch.uint8), scale


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> int8 [N, K] values in [-8, 7]."""
    p = packed.to(torch.int16)
    low, high = p & 0xF, p >> 4
    q = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)
    return torch.where(q >= 8, q - 16, q).to(torch.int8)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight an int8 [N, K] or packed int4 (uint8 [N, K / 2]) one stands for, [N, K] in `dtype`."""
    q = unpack_int4(weight) if weight.dtype == torch.uint8 else weight
    return (q.float() * scale.float()[:, None]).to(dtype)


def weight_only_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ dequant(weight)^T (+ bias); x [..., K] in the model's dtype, weight int8 [N, K] or packed int4
    uint8 [N, K / 2], scale fp32 [N]."""
    rows = x.numel() // x.shape[-1]
    if x.is_cuda and rows == 1:  # one row: the GEMV reads the stored rows as they are
        from mmserve.kernels.gemv import gemv, gemv_int4

        if weight.dtype == torch.uint8:
            y = gemv_int4(x.reshape(-1), weight, bias, scale, x.dtype)
        else:
            y = gemv(x.reshape(-1), weight, bias, weight_scale=scale)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        from mmserve.kernels.fastest import run_fastest
        from mmserve.kernels.m_tiles import SMALL_M
        from mmserve.kernels.weight_only_gemm import weight_only_gemm

        x2 = x.reshape(rows, -1).contiguous()
        if rows <= SMALL_M:
            y = weight_only_gemm(x2, weight, scale, bias)
        else:  # compute-bound: the in-register dequantization, or cuBLAS on a dequantized copy if that was faster
            key = (
                "weight_only_linear",
                tuple(weight.shape),
                weight.dtype,
                x.dtype,
                rows_bucket(rows),
                x.device,
            )
            y = run_fastest(
                key,
                [
                    lambda: weight_only_gemm(x2, weight, scale, bias),
                    lambda: F.linear(x2, dequantize(weight, scale, x.dtype), bias),
                ],
            )
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, dequantize(weight, scale, x.dtype), bias)


def rows_bucket(rows: int) -> int:
    """Row counts that share one timing of the two large-M paths: powers of two."""
    return 1 << max(0, rows - 1).bit_length()
