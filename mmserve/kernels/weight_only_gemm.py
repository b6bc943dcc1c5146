"""Triton GEMM for a few activation rows against weight-only int8 / packed int4 weights (layers/weight_only.py):
y [M, N] = (x [M, K] @ q^T) * s[n] (+ bias), for M up to SMALL_M (batched decode), where the step reads the
weights once and a narrow-N tile spreads them over every SM.

Each program multiplies a [BLOCK_M, BLOCK_K] tile of x by a [BLOCK_K, BLOCK_N] tile of W^T on the tensor cores
in the activations' dtype (int8 and int4 values are exact there) with fp32 accumulation, and applies the row
scales once at the end. Packed int4 tiles are [BLOCK_K / 2, BLOCK_N] bytes: the low nibbles multiply x's even
columns, the high nibbles its odd ones, so nothing is interleaved in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.pdl import pdl_options, wait_for_previous

SMALL_M = 64
_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bm in (16, 32, 64)
            for bn, bk, w, st in [(32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 256, 8, 3),
                                  (128, 128, 8, 3), (16, 256, 4, 4)]]


def _m_tile(m: int) -> int:
    return min(max(16, triton.next_power_of_2(m)), 64)


def _prune_m_tiles(configs, named_args, **kwargs):
    bm = _m_tile(named_args["M"])
    return [c for c in configs if c.kwargs["BLOCK_M"] == bm]


@triton.jit
def _unpack(nibbles):
    """int32 values 0..15 -> the signed 4-bit values they encode."""
    return tl.where(nibbles >= 8, nibbles - 16, nibbles)


@triton.autotune(configs=_CONFIGS, key=["M_TILE", "N", "K", "INT4"],
                 prune_configs_by={"early_config_prune": _prune_m_tiles}, do_bench=bench_ms)
@triton.jit
def _weight_only_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, M_TILE,
                             INT4: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if INT4:
        rb = tl.arange(0, BLOCK_K // 2)            # bytes of a K tile: 2 weights each
        for k in range(0, K, BLOCK_K):
            b_mask = (k // 2 + rb) < K // 2
            packed = tl.load(w_cols + k // 2 + rb[:, None], mask=b_mask[:, None] & n_mask[None, :], other=0)
            packed = packed.to(tl.int32)
            x_even = tl.load(x_rows + k + 2 * rb[None, :], mask=m_mask[:, None] & b_mask[None, :], other=0.0)
            x_odd = tl.load(x_rows + k + 2 * rb[None, :] + 1, mask=m_mask[:, None] & b_mask[None, :], other=0.0)
            acc = tl.dot(x_even, _unpack(packed & 0xF).to(x_even.dtype), acc)
            acc = tl.dot(x_odd, _unpack(packed >> 4).to(x_odd.dtype), acc)
    else:
        rk = tl.arange(0, BLOCK_K)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + rk) < K
            x = tl.load(x_rows + k + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + k + rk[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
            acc = tl.dot(x, w.to(x.dtype), acc)
    y = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def weight_only_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] in x's dtype for x [M, K] (unit stride along K) and an int8 [N, K] or packed int4 uint8 [N, K / 2]
    weight with fp32 row scales [N]."""
    m, k = x.shape
    n = weight.shape[0]
    int4 = weight.dtype == torch.uint8
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = (x, weight, scale, bias if bias is not None else scale, y, m, n, k, x.stride(0), weight.stride(0),
            y.stride(0), _m_tile(m))
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))   # noqa: E731
        _weight_only_gemm_kernel[grid](*args, INT4=int4, HAS_BIAS=bias is not None, **pdl_options(x.device))
    else:   # Triton's interpreter (CPU tests): one fixed config
        _weight_only_gemm_kernel.fn[(triton.cdiv(n, 16), triton.cdiv(m, 16))](
            *args, INT4=int4, HAS_BIAS=bias is not None, PDL=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)
    return y
