"""Triton GEMV for one row against group-wise int4 weights (batch-1 decode: a stream of weight reads), in the
layout and with the dequantization of kernels/group_int4_gemm.py.

Each program takes BLOCK_N rows and walks K in tiles of BLOCK_K columns viewed as [BLOCK_N, group parts, blocks of
16 columns, 8 bytes], a block's 8 bytes held by one thread (one 8-byte load per row; its 8 + 8 activations two
16-byte loads). With groups of a power of two (no g_idx) a part's zero and scale are loaded once per thread and row
into registers: the products (q - z) x are summed per part, then scaled once, so the inner loop is a nibble
extraction, one subtraction and one multiply-add per weight. Otherwise (g_idx, other group sizes) each column's
group is looked up and scaled before the sum. Every tensor of the loop has the weights' layout (zeros and scales
too), so nothing is exchanged through shared memory. The first weight tile is read before waiting for the
previous kernel (programmatic dependent launch, kernels/pdl.py). llava-1.5-7b's shapes give N / BLOCK_N >= 256
programs for 132 SMs, so K is not split: each program reduces its rows once and writes them, with no second pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.group_int4_gemm import HALF_BLOCK, check_layout, dequant_pair
from mmserve.kernels.pdl import pdl_options, wait_for_previous

_GEMV_TILES = [  # (BLOCK_N, BLOCK_K: columns of each row per tile, warps, stages)
    (8, 2048, 4, 3),
    (4, 2048, 4, 3),
    (8, 4096, 8, 2),
    (4, 4096, 8, 3),
    (2, 2048, 4, 3),
    (4, 1024, 4, 3),
    (8, 1024, 4, 3),
    (2, 1024, 4, 4),
    (1, 2048, 4, 3),
    (16, 512, 8, 3),
]
# SHARED_X: the tile's blocks (BLOCK_K / 16) fill every thread of every warp, so a thread's rows share its
# activations (read once, kept in registers); else each thread reads them for each of its rows (L1 hits)
GEMV_CONFIGS = [
    triton.Config(
        {"BLOCK_N": bn, "BLOCK_K": bk, "SHARED_X": bk // 16 >= 32 * w}, num_warps=w, num_stages=s
    )
    for bn, bk, w, s in _GEMV_TILES
]
_CPU_GEMV = dict(BLOCK_N=8, BLOCK_K=64, SHARED_X=False)  # Triton's interpreter: one fixed config


@triton.jit
def _gemv_tile(
    packed,
    k,
    x_ptr,
    rows,
    n_mask,
    g_ptr,
    s_ptr,
    z_ptr,
    K,
    GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    PER_GROUP: tl.constexpr,
    GPT: tl.constexpr,
    BPG: tl.constexpr,
    SHARED_X: tl.constexpr,
):
    """Partial sums of one [BLOCK_N, GPT, BPG, 8] byte tile starting at column k: [BLOCK_N, GPT, BPG, 1]."""
    blocks = tl.arange(0, GPT)[:, None, None] * BPG + tl.arange(0, BPG)[None, :, None]
    cols = (
        k + blocks * (2 * HALF_BLOCK) + tl.arange(0, HALF_BLOCK)[None, None, :]
    )  # low nibbles' columns
    starts = k + blocks * (2 * HALF_BLOCK)
    c_lo, c_hi = (
        (starts < K)[None],
        (starts + HALF_BLOCK < K)[None],
    )  # per half block: K is a multiple of 8
    if SHARED_X:
        x_cols = cols[None]
    else:  # x as a tile of the weights' shape: loaded in their layout, no exchange through shared memory
        x_cols = tl.broadcast_to(cols[None], packed.shape)
    x_lo = tl.load(x_ptr + x_cols, mask=c_lo, other=0.0).to(tl.float32)
    x_hi = tl.load(x_ptr + x_cols + HALF_BLOCK, mask=c_hi, other=0.0).to(tl.float32)
    if PER_GROUP:  # a [row, g] part lies in one group: its first column names it
        # the part's first column for each block, [1, GPT, BPG, 1]: the scales and zeros are loaded in the layout
        # of the weights' blocks (one per thread and row), so no tile is exchanged through shared memory
        first = (k + (blocks // BPG) * (BPG * 2 * HALF_BLOCK))[None]
        mask = n_mask & (first < K)  # K is a multiple of GROUP here
        lo, hi = dequant_pair(
            packed, rows, mask, mask, first, g_ptr, s_ptr, z_ptr, GROUP, False, False, tl.float32
        )
        s = tl.load(s_ptr + rows + first // GROUP, mask=mask, other=0.0).to(tl.float32)
        low = tl.sum(lo * x_lo, axis=3, keep_dims=True)
        return (low + tl.sum(hi * x_hi, axis=3, keep_dims=True) * 0.0625) * s
    else:
        lo_mask, hi_mask = n_mask & c_lo, n_mask & c_hi
        lo, hi = dequant_pair(
            packed,
            rows,
            lo_mask,
            hi_mask,
            cols[None],
            g_ptr,
            s_ptr,
            z_ptr,
            GROUP,
            HAS_G_IDX,
            True,
            tl.float32,
        )
        return tl.sum(lo * x_lo + hi * x_hi, axis=3, keep_dims=True)


@triton.autotune(configs=GEMV_CONFIGS, key=["N", "K", "GROUP", "HAS_G_IDX"], do_bench=bench_ms)
@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    G,
    stride_w,
    GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    PER_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHARED_X: tl.constexpr,
    PDL: tl.constexpr,
):
    # A tile row is GPT parts of BPG blocks of 16 columns (8 bytes), each part in one group where PER_GROUP. The
    # 8 bytes of a block are one thread's: its rows meet the same 8 + 8 activations, loaded once for all rows.
    BPG: tl.constexpr = (GROUP if (PER_GROUP and GROUP < BLOCK_K) else BLOCK_K) // (2 * HALF_BLOCK)
    GPT: tl.constexpr = BLOCK_K // (BPG * 2 * HALF_BLOCK)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn4 = rn[:, None, None, None]
    n_mask = rn4 < N
    rows = rn4.to(tl.int64) * G  # scale / zero offsets of the rows
    blocks = tl.arange(0, GPT)[:, None, None] * BPG + tl.arange(0, BPG)[None, :, None]
    t = (blocks * HALF_BLOCK + tl.arange(0, HALF_BLOCK)[None, None, :])[None]  # bytes of the tile
    w_rows = w_ptr + rn4.to(tl.int64) * stride_w + t
    b_cols = (blocks * (2 * HALF_BLOCK))[None]  # a block's first column, for whole-block masks
    # weights are never written during a forward pass: the first tile is read before the wait (kernels/pdl.py)
    packed = tl.load(w_rows, mask=n_mask & (b_cols < K), other=0)
    wait_for_previous(PDL)
    acc = _gemv_tile(
        packed,
        0,
        x_ptr,
        rows,
        n_mask,
        g_ptr,
        s_ptr,
        z_ptr,
        K,
        GROUP,
        HAS_G_IDX,
        PER_GROUP,
        GPT,
        BPG,
        SHARED_X,
    )
    for k in range(BLOCK_K, K, BLOCK_K):
        packed = tl.load(w_rows + k // 2, mask=n_mask & (k + b_cols < K), other=0)
        acc += _gemv_tile(
            packed,
            k,
            x_ptr,
            rows,
            n_mask,
            g_ptr,
            s_ptr,
            z_ptr,
            K,
            GROUP,
            HAS_G_IDX,
            PER_GROUP,
            GPT,
            BPG,
            SHARED_X,
        )
    y = tl.sum(tl.reshape(acc, [BLOCK_N, GPT * BPG]), axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=rn < N)


def group_int4_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """y [N] (x's dtype) for one row x [K]; weight uint8 [N, K / 2] (rounded up to blocks of 16 columns), scales /
    zeros [N, G], g_idx int32 [K]. `config`: one of GEMV_CONFIGS instead of the autotuner's choice."""
    x = x.reshape(-1).contiguous()
    n, k, g, b, flags = check_layout(weight, scales, zeros, g_idx, bias, group_size, x.numel())
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    args = (x, weight, scales, zeros, g, b, y, n, k, scales.shape[1], weight.stride(0))
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    if config is not None:
        _gemv_kernel.fn[grid(config.kwargs)](
            *args, **flags, **config.all_kwargs(), **pdl_options(x.device)
        )
    elif x.is_cuda:
        _gemv_kernel[grid](*args, **flags, **pdl_options(x.device))
    else:  # Triton's interpreter (CPU tests): one fixed config
        _gemv_kernel.fn[(triton.cdiv(n, _CPU_GEMV["BLOCK_N"]),)](*args, **flags, **_CPU_GEMV, PDL=0)
    return y
