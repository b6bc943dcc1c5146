"""FP8 (e4m3) W8A8 products of a few activation rows (decode, M <= 64) on the tensor cores with the operands
swapped: y^T [N, M] = W [N, K] @ xq^T [K, M], then scaled by the row scales (`fp8_gemm_swap_ab`).

Why a second kernel beside kernels/fp8_gemm.py's: its one-row path (kernels/gemv.py's GEMV) turns every e4m3
weight into fp32 on the CUDA cores (a `cvt.rn.f16x2.e4m3x2` per two weights, a `cvt.f32.f16` and an FMA per
weight): compiled for sm_90 its loop issues ~4.2 instructions per weight byte against the fp16 GEMV's ~1.5
(docs/lab/2026-11-27-fp8-decode-analysis.md). Tensor cores take e4m3 as it is stored. The small-M GEMM of
fp8_gemm.py does, but with the activations as the left operand, whose rows (16 at least) are mostly padding at
decode sizes, and it reads no weight before its PDL wait. Here the weights are the left operand, so a tile of 64
or 128 weight rows fills the 64-row MMA of a Hopper warpgroup and the activation rows are its narrow right
operand; the first weight tile is read before waiting for the previous kernel, as kernels/gemv.py does (weights
are never written during a forward pass, kernels/pdl.py).

It is a candidate of fp8_gemm.fp8_matmul_quantized's per-shape choice (kernels/fastest.run_fastest): it runs only
where it was timed faster than the kernels that were there before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.m_tiles import SMALL_M, m_tile
from mmserve.kernels.pdl import pdl_options, wait_for_previous

SWAP_MAX_M = SMALL_M  # the activation rows of one program (m_tile: the MMA's narrow side)
# (weight rows, K per tile, warps, stages): 16 / 32 weight rows give N = 4096 at least 128 programs; 64 / 128 rows
# fill a warpgroup's 64-row MMA
_TILES = [
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 4, 4),
    (32, 512, 4, 3),
    (64, 256, 4, 4),
    (64, 512, 4, 3),
    (128, 256, 4, 3),
    (128, 256, 8, 4),
    (64, 128, 4, 6),
]
SWAP_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in _TILES
]


@triton.autotune(configs=SWAP_CONFIGS, key=["M_TILE", "N", "K", "SPLIT_K"], do_bench=bench_ms)
@triton.jit
def _swap_ab_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    M_TILE,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)  # every activation row (M <= SWAP_MAX_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask, m_mask = rn < N, rm < M
    # this program's K range: all of it, or its split's whole tiles
    k_lo = tl.program_id(1) * (tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K)
    k_hi = tl.minimum(K, k_lo + tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K)
    w_ptrs = (
        w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    )  # [BLOCK_N, BLOCK_K], K-major
    x_ptrs = (
        xq_ptr + rm[None, :].to(tl.int64) * stride_x + rk[:, None]
    )  # xq^T [BLOCK_K, BLOCK_M], K-major
    # the first weight tile before the wait: its HBM read overlaps the previous kernel's tail
    w = tl.load(w_ptrs + k_lo, mask=n_mask[:, None] & (k_lo + rk < k_hi)[None, :], other=0.0)
    wait_for_previous(PDL)
    x = tl.load(x_ptrs + k_lo, mask=(k_lo + rk < k_hi)[:, None] & m_mask[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # Hopper's FP8 tensor cores accumulate with ~14 mantissa bits; fold into fp32 every 32 products
    acc = tl.dot(w, x, acc, max_num_imprecise_acc=32)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k_mask = (k + rk) < k_hi
        w = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs + k, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        acc = tl.dot(w, x, acc, max_num_imprecise_acc=32)
    if (
        SPLIT_K > 1
    ):  # unscaled partial sums [SPLIT_K, M, N] (y_ptr: fp32), merged by _split_k_reduce_kernel
        part = y_ptr + (tl.program_id(1) * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(part, acc, mask=n_mask[:, None] & m_mask[None, :])
    else:
        _store_scaled(acc, rm, rn, m_mask, n_mask, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_y, HAS_BIAS)


@triton.jit
def _store_scaled(
    acc, rm, rn, m_mask, n_mask, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_y, HAS_BIAS: tl.constexpr
):
    """y[m, n] = acc[n, m] * xs[m] * ws[n] (+ b[n]): the order of fp8_gemm's kernel and of the reference."""
    xs = tl.load(xs_ptr + rm, mask=m_mask, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
    y = acc * xs[None, :] * ws[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(
        y_ptr + rm[None, :] * stride_y + rn[:, None],
        y.to(y_ptr.dtype.element_ty),
        mask=n_mask[:, None] & m_mask[None, :],
    )


@triton.jit
def _split_k_reduce_kernel(
    part_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_y,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """y = (sum of the SPLIT_K partials, in split order) * xs * ws (+ b), for BLOCK_N columns of every row."""
    wait_for_previous(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_mask, m_mask = rn < N, rm < M
    ptrs = (
        part_ptr + rn[:, None] + rm[None, :].to(tl.int64) * N
    )  # [BLOCK_N, BLOCK_M], as the GEMM's acc
    mask = n_mask[:, None] & m_mask[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0)
    _store_scaled(acc, rm, rn, m_mask, n_mask, xs_ptr, ws_ptr, b_ptr, y_ptr, stride_y, HAS_BIAS)


def split_k_for(n: int, k: int) -> int:
    """Split-K partitions that give a GEMM of n weight rows about 256 programs of 64 rows (two per SM of an
    H100) where it has fewer; 1 where it has enough, or where a partition would be shorter than 512."""
    tiles = triton.cdiv(n, 64)
    return max(1, min(8, triton.cdiv(256, tiles), k // 512)) if tiles < 256 else 1


def fp8_gemm_swap_ab(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    split_k: int = 1,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """y [M, N] = (xs ⊗ ws) * (xq @ weight^T) (+ bias) for up to SWAP_MAX_M quantized rows xq [M, K] (scales xs
    [M]) and an e4m3 weight [N, K] with row scales ws [N], both with unit stride along K; summed in fp32 (partial
    sums of 32 products in the tensor cores' accumulator). `split_k` > 1: K in that many partitions, their fp32
    sums merged by a second kernel in a fixed order (deterministic). `config`: one tile of SWAP_CONFIGS instead
    of the autotuned choice."""
    m, k = xq.shape
    n = weight.shape[0]
    assert m <= SWAP_MAX_M and xq.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    out = y if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=xq.device)
    bias_arg = bias if bias is not None else weight_scale
    args = (
        xq,
        xs,
        weight,
        weight_scale,
        bias_arg,
        out,
        m,
        n,
        k,
        xq.stride(0),
        weight.stride(0),
        y.stride(0),
    )
    flags = dict(HAS_BIAS=bias is not None, BLOCK_M=m_tile(m), SPLIT_K=split_k)
    pdl = pdl_options(xq.device)
    if not xq.is_cuda:  # Triton's interpreter (CPU tests): one small tile
        _swap_ab_kernel.fn[(triton.cdiv(n, 16), split_k)](
            *args, m_tile(m), **flags, BLOCK_N=16, BLOCK_K=32, PDL=False
        )
    elif config is not None:
        grid = (triton.cdiv(n, config.kwargs["BLOCK_N"]), split_k)
        _swap_ab_kernel.fn[grid](*args, m_tile(m), **flags, **config.all_kwargs(), **pdl)
    else:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split_k)  # noqa: E731
        _swap_ab_kernel[grid](*args, m_tile(m), **flags, **pdl)
    if split_k > 1:
        block_n = 128 if out.is_cuda else 16
        _split_k_reduce_kernel[(triton.cdiv(n, block_n),)](
            out, xs, weight_scale, bias_arg, y, m, n, y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK_M=m_tile(m), BLOCK_N=block_n,
            **pdl,
        )  # fmt: skip
    return y
