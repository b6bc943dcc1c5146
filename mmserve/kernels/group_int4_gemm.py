"""Triton kernels for group-wise int4 weights (layers/group_quant_linear.py's layout): y [M, N] = x [M, K] @ W^T
(+ bias) with W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], q packed two to a byte along K (uint8 [N, K / 2], the
even column in the low nibble), s fp16 [N, G], z uint8 [N, G], g(k) = k // GROUP or g_idx[k] (GPTQ act-order and
row-parallel shards that do not hold whole groups).

`group_int4_gemv` (one row, batch-1 decode: a stream of weight reads) gives each program BLOCK_N rows and keeps an
fp32 [BLOCK_N, BLOCK_K / 2] partial sum in registers, reduced once at the end. `group_int4_gemm` (more rows) computes
[BLOCK_N, BLOCK_M] tiles of y^T = W x^T on the tensor cores (operands swapped as in kernels/weight_only_gemm.py: the
dequantized weight tile is the left operand, a few rows of x the narrow side). Both dequantize in registers: the
nibbles less their group's zero (exact small integers) times its scale in fp32, then the activations' dtype. Where
a K tile lies inside one group (GROUP a multiple of BLOCK_K, no g_idx) each row's scale and zero are loaded once per
tile; otherwise per column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms

SMALL_M = 64
_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [
        (4, 256, 4, 3),
        (4, 512, 4, 3),
        (8, 256, 4, 3),
        (8, 512, 8, 3),
        (16, 128, 4, 4),
        (16, 256, 8, 3),
        (2, 1024, 4, 3),
        (1, 1024, 4, 3),
    ]
]
_GEMM_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm in (16, 32, 64)
    for bn, bk, w, st in [
        (64, 128, 4, 4),
        (128, 128, 8, 3),
        (32, 128, 4, 4),
        (64, 64, 4, 4),
        (16, 128, 4, 3),
    ]
] + [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4), (256, 64, 8, 3)]
]


def _m_tile(m: int) -> int:
    return min(max(16, triton.next_power_of_2(m)), 64) if m <= SMALL_M else 128


def _prune_m_tiles(configs, named_args, **kwargs):
    return [c for c in configs if c.kwargs["BLOCK_M"] == _m_tile(named_args["M"])]


@triton.jit
def _dequant(
    q,
    rn,
    cols,
    k,
    s_ptr,
    z_ptr,
    g_ptr,
    n_mask,
    G,
    GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """(q - z) * s for a [BLOCK_N, C] tile of nibbles q whose columns are k + cols, in DTYPE."""
    rows = rn[:, None].to(tl.int64) * G
    if HAS_G_IDX:
        g = tl.load(g_ptr + k + cols)[None, :]
        s = tl.load(s_ptr + rows + g, mask=n_mask[:, None], other=0.0)
        z = tl.load(z_ptr + rows + g, mask=n_mask[:, None], other=0)
    elif GROUP % BLOCK_K == 0:  # the whole tile in one group: a scale and a zero per row
        s = tl.load(s_ptr + rows + k // GROUP, mask=n_mask[:, None], other=0.0)
        z = tl.load(z_ptr + rows + k // GROUP, mask=n_mask[:, None], other=0)
    else:
        g = ((k + cols) // GROUP)[None, :]
        s = tl.load(s_ptr + rows + g, mask=n_mask[:, None], other=0.0)
        z = tl.load(z_ptr + rows + g, mask=n_mask[:, None], other=0)
    return ((q.to(tl.int32) - z.to(tl.int32)).to(tl.float32) * s.to(tl.float32)).to(DTYPE)


@triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "GROUP", "HAS_G_IDX"], do_bench=bench_ms)
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
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rb = tl.arange(0, BLOCK_K // 2)  # bytes of a K tile
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K // 2], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        b_mask = (k // 2 + rb) < K // 2
        packed = tl.load(
            w_rows + k // 2 + rb[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0
        )
        x_even = tl.load(x_ptr + k + 2 * rb, mask=b_mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + k + 2 * rb + 1, mask=b_mask, other=0.0).to(tl.float32)
        cols = tl.where(b_mask, 2 * rb, 0)  # masked columns read group 0 (and multiply zeros)
        lo = _dequant(
            packed & 0xF,
            rn,
            cols,
            k,
            s_ptr,
            z_ptr,
            g_ptr,
            n_mask,
            G,
            GROUP,
            HAS_G_IDX,
            BLOCK_K,
            tl.float32,
        )
        hi = _dequant(
            packed >> 4,
            rn,
            tl.where(b_mask, 2 * rb + 1, 0),
            k,
            s_ptr,
            z_ptr,
            g_ptr,
            n_mask,
            G,
            GROUP,
            HAS_G_IDX,
            BLOCK_K,
            tl.float32,
        )
        acc += lo * x_even[None, :] + hi * x_odd[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.autotune(
    configs=_GEMM_CONFIGS,
    key=["M_TILE", "N", "K", "GROUP", "HAS_G_IDX"],
    prune_configs_by={"early_config_prune": _prune_m_tiles},
    do_bench=bench_ms,
)
@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    G,
    stride_x,
    stride_w,
    stride_y,
    M_TILE,
    GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile
    for k in range(0, K, BLOCK_K):
        x = tl.load(
            x_rows + k + rk[None, :], mask=m_mask[:, None] & ((k + rk) < K)[None, :], other=0.0
        )
        b_mask = (k // 2 + rb) < K // 2
        packed = tl.load(
            w_rows + k // 2 + rb[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0
        )
        cols = tl.where(b_mask, 2 * rb, 0)
        lo = _dequant(
            packed & 0xF,
            rn,
            cols,
            k,
            s_ptr,
            z_ptr,
            g_ptr,
            n_mask,
            G,
            GROUP,
            HAS_G_IDX,
            BLOCK_K,
            x.dtype,
        )
        hi = _dequant(
            packed >> 4,
            rn,
            tl.where(b_mask, 2 * rb + 1, 0),
            k,
            s_ptr,
            z_ptr,
            g_ptr,
            n_mask,
            G,
            GROUP,
            HAS_G_IDX,
            BLOCK_K,
            x.dtype,
        )
        x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
        acc = tl.dot(lo, tl.trans(x_even), acc)
        acc = tl.dot(hi, tl.trans(x_odd), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(
        y_ptr + rm[None, :] * stride_y + rn[:, None],
        acc.to(y_ptr.dtype.element_ty),
        mask=n_mask[:, None] & m_mask[None, :],
    )


def _common(weight, scales, zeros, g_idx, bias, group_size):
    n, k = weight.shape[0], 2 * weight.shape[1]
    assert weight.stride(1) == 1 and scales.is_contiguous() and zeros.is_contiguous(), (
        "contiguous layout"
    )
    g = g_idx if g_idx is not None else zeros  # an unread pointer
    flags = dict(GROUP=group_size, HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None)
    return n, k, g, bias if bias is not None else scales, flags


def group_int4_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [N] (x's dtype) for one row x [K]; weight uint8 [N, K / 2], scales / zeros [N, G], g_idx int32 [K]."""
    n, k, g, b, flags = _common(weight, scales, zeros, g_idx, bias, group_size)
    x = x.reshape(-1).contiguous()
    assert x.numel() == k, (tuple(x.shape), tuple(weight.shape))
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    args = (x, weight, scales, zeros, g, b, y, n, k, scales.shape[1], weight.stride(0))
    if x.is_cuda:
        _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    else:  # Triton's interpreter (CPU tests): one fixed config
        _gemv_kernel.fn[(triton.cdiv(n, 8),)](*args, **flags, BLOCK_N=8, BLOCK_K=32)
    return y


def group_int4_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] (x's dtype) for x [M, K] (unit stride along K); the weights as for `group_int4_gemv`."""
    n, k, g, b, flags = _common(weight, scales, zeros, g_idx, bias, group_size)
    m = x.shape[0]
    assert x.shape[1] == k and x.stride(1) == 1, (tuple(x.shape), tuple(weight.shape))
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = (
        x,
        weight,
        scales,
        zeros,
        g,
        b,
        y,
        m,
        n,
        k,
        scales.shape[1],
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        _m_tile(m),
    )
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))  # noqa: E731
        _gemm_kernel[grid](*args, **flags)
    else:
        _gemm_kernel.fn[(triton.cdiv(n, 16), triton.cdiv(m, 16))](
            *args, **flags, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32
        )
    return y
