"""Triton kernel writing a group-wise int4 weight (kernels/group_int4_gemm.py's layout) out as a dense W [N, K] in
the model's dtype, for prompts: cuBLAS on a copy dequantized for the call is the other candidate that
layers/group_int4_linear.py times against the int4 GEMM past SMALL_M rows. One pass reads the packed bytes (half a
byte per weight) and writes two bytes per weight, so a 7B model's decoder costs about 6 ms at an H100's bandwidth;
the torch reference (layers/group_int4_linear.dequantize_packed) takes several passes through fp32 copies.

Each value is `dequant_pair`'s exact (q - z) * s in fp32 rounded once to the dtype, as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.group_int4_gemm import HALF_BLOCK, check_layout, dequant_pair, low_columns


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    out_ptr,
    N,
    K,
    G,
    stride_w,
    stride_out,
    GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)  # bytes; a tile starts on a block of 8
    low = low_columns(rb)
    n_mask = rn < N
    lo_mask = n_mask[:, None] & (low < K)[None, :]
    hi_mask = n_mask[:, None] & (low + HALF_BLOCK < K)[None, :]
    packed = tl.load(
        w_ptr + rn[:, None].to(tl.int64) * stride_w + rb[None, :], mask=lo_mask, other=0
    )
    rows = rn[:, None].to(tl.int64) * G
    lo, hi = dequant_pair(
        packed,
        rows,
        lo_mask,
        hi_mask,
        low[None, :],
        g_ptr,
        s_ptr,
        z_ptr,
        GROUP,
        HAS_G_IDX,
        True,
        out_ptr.dtype.element_ty,
    )
    out = out_ptr + rn[:, None].to(tl.int64) * stride_out + low[None, :]
    tl.store(out, lo, mask=lo_mask)
    tl.store(out + HALF_BLOCK, hi, mask=hi_mask)


def group_int4_dequant(
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
    k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """W [N, K] in `dtype` = (q - z[:, g]) * s[:, g] from the packed layout (uint8 [N, K / 2] in blocks of 16
    columns) of K input features."""
    n, k, g, _, flags = check_layout(weight, scales, zeros, g_idx, None, group_size, k)
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    block_n, block_b = (16, 64) if weight.is_cuda else (8, 16)
    grid = (triton.cdiv(n, block_n), triton.cdiv(weight.shape[1], block_b))
    _dequant_kernel[grid](
        weight,
        scales,
        zeros,
        g,
        out,
        n,
        k,
        scales.shape[1],
        weight.stride(0),
        out.stride(0),
        GROUP=flags["GROUP"],
        HAS_G_IDX=flags["HAS_G_IDX"],
        BLOCK_N=block_n,
        BLOCK_B=block_b,
        num_warps=4,
    )
    return out
