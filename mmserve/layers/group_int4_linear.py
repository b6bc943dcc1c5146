"""Group-wise int4 linear math and its dispatch: y = x @ W^T (+ bias) with W = (q - z[:, g]) * s[:, g]
(layers/group_quant_linear.py holds the weights, kernels/group_int4_gemv.py and group_int4_gemm.py the Triton
kernels).

On CUDA in fp16 / bf16: one row (batch-1 decode) goes to whichever of the Triton GEMV and GEMM was timed faster for
the shape (kernels/fastest.py); up to SMALL_M rows (batched decode) to the Triton GEMM with K whole or split in 2 or
4 shares, whichever timed faster; more rows (prompts, compute-bound) to whichever of that GEMM and cuBLAS on a copy
dequantized for the call (kernels/group_int4_dequant.py) was timed faster.
Elsewhere (the CPU) the weight is dequantized in fp32 ((q - z) * s is exact there: a small integer times an fp16
scale) and multiplied in the activations' dtype, so an fp32 model equals the fp32 model holding the dequantized
weights up to summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.layers.group_int4 import dequantize_groups, unpack_nibbles_k

SPLITS = (1, 2, 4)  # K shares of the int4 GEMM for decode batches


def dequantize_packed(
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W [N, K] in `dtype` from the layers' layout (uint8 [N, K / 2] padded to blocks of 16 columns, scales / zeros
    [N, G], optional g_idx); K is len(g_idx), else G * group_size."""
    k = g_idx.numel() if g_idx is not None else scales.shape[1] * group_size
    return dequantize_groups(unpack_nibbles_k(weight, k), scales, zeros, group_size, g_idx, dtype)


def group_int4_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] in x's dtype for x [..., K]."""
    n = weight.shape[0]
    rows = x.numel() // x.shape[-1]
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        from mmserve.kernels.fastest import run_fastest
        from mmserve.kernels.group_int4_dequant import group_int4_dequant
        from mmserve.kernels.group_int4_gemm import group_int4_gemm
        from mmserve.kernels.group_int4_gemv import group_int4_gemv
        from mmserve.kernels.m_tiles import SMALL_M, m_tile
        from mmserve.layers.weight_only import rows_bucket

        x2 = x.reshape(rows, -1).contiguous()
        args = (weight, scales, zeros, group_size, g_idx, bias)
        if rows == 1:  # the GEMV or the tensor-core GEMM (16-row tiles), whichever timed faster
            key = ("group_int4_one_row", tuple(weight.shape), group_size, g_idx is not None)
            y = run_fastest(
                (*key, bias is not None, x.dtype, x.device),
                [lambda: group_int4_gemv(x2, *args)[None], lambda: group_int4_gemm(x2, *args)],
            )
        elif rows <= SMALL_M:
            # K in 1, 2 or 4 shares (kernels/group_int4_gemm.py), whichever timed faster
            key = ("group_int4_rows", tuple(weight.shape), group_size, g_idx is not None)
            y = run_fastest(
                (*key, bias is not None, x.dtype, m_tile(rows), x.device),
                [
                    lambda split=split: group_int4_gemm(x2, *args, split_k=split)
                    for split in SPLITS
                    if split == 1 or x2.shape[1] >= 1024 * split
                ],
            )
        else:
            key = (
                "group_int4_linear",
                tuple(weight.shape),
                group_size,
                g_idx is not None,
                x.dtype,
                rows_bucket(rows),
                x.device,
            )
            y = run_fastest(
                key,
                [
                    lambda: group_int4_gemm(x2, *args),
                    lambda: F.linear(
                        x2,
                        group_int4_dequant(
                            weight, scales, zeros, group_size, g_idx, x.shape[-1], x.dtype
                        ),
                        bias,
                    ),
                ],
            )
        return y.reshape(*x.shape[:-1], n)
    w = dequantize_packed(weight, scales, zeros, group_size, g_idx, torch.float32).to(x.dtype)
    return F.linear(x, w, bias)
