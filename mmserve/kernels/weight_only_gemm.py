"""Triton GEMM for activation rows against weight-only int8 / packed int4 weights (layers/weight_only.py):
y [M, N] = (x [M, K] @ q^T) * s[n] (+ bias). Up to SMALL_M rows (batched decode) a step reads the weights once and
is bound by their bytes; more rows (prompt chunks) are compute-bound and get larger tiles. The same kernel takes
weights in the activations' dtype (`small_m_gemm`, no scales): a candidate against cuBLAS for batched decode
(layers/linear.py `linear` times both per shape).

The operands are swapped: each program computes a [BLOCK_N, BLOCK_M] tile of y^T = W x^T, so the weight tile,
turned into the activations' dtype in registers (kernels/gemv.py `int8_as_float` / `int4_as_float`: exact, and
without int-to-float instructions), is the tensor cores' left operand, which Hopper's wgmma may take from registers,
while x^T comes from shared memory as loaded; a few rows of x are the narrow side of the product. fp32
accumulation, the row scales applied once at the end. Packed int4 tiles are [BLOCK_N, BLOCK_K / 2] bytes: the low
nibbles multiply x's even columns, the high nibbles its odd ones (x read whole, then split).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.gemv import int4_as_float, int8_as_float
from mmserve.kernels.m_tiles import m_tile, prune_m_tiles
from mmserve.kernels.pdl import pdl_options, release_dependents, wait_for_previous

# BLOCK_N is the tensor cores' M side here (operands swapped, module docstring): Hopper's wgmma wants 64 or more;
# 16 / 32 fall back to the older mma but spread N = 4096 over more SMs, which the weight-read-bound small-M steps
# may prefer. Past SMALL_M rows the GEMM is compute-bound: square-ish tiles.
_SMALL_M_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm in (16, 32, 64)
    for bn, bk, w, st in [
        (64, 128, 4, 4),
        (64, 256, 4, 3),
        (64, 256, 4, 4),
        (128, 128, 8, 3),
        (128, 256, 8, 3),
        (64, 512, 4, 3),
        (32, 256, 4, 4),
        (32, 512, 4, 3),
        (16, 512, 4, 3),
        (128, 128, 4, 4),
    ]
]
_LARGE_M_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [
        (128, 64, 8, 3),
        (128, 64, 4, 4),
        (256, 64, 8, 3),
        (64, 64, 4, 4),
        (128, 128, 8, 3),
        (64, 128, 4, 3),
    ]
]


@triton.autotune(
    configs=_SMALL_M_CONFIGS + _LARGE_M_CONFIGS,
    key=["M_TILE", "N", "K", "INT4", "FLOAT_W"],
    prune_configs_by={"early_config_prune": prune_m_tiles},
    do_bench=bench_ms,
)
@triton.jit
def _weight_only_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    M_TILE,
    INT4: tl.constexpr,
    FLOAT_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile
    for k in range(0, K, BLOCK_K):
        x = tl.load(
            x_rows + k + rk[None, :], mask=m_mask[:, None] & ((k + rk) < K)[None, :], other=0.0
        )
        if INT4:
            rb = tl.arange(0, BLOCK_K // 2)  # bytes of a K tile: 2 weights each
            b_mask = (k // 2 + rb) < K // 2
            packed = tl.load(
                w_rows + k // 2 + rb[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0
            )
            low, high = int4_as_float(packed, x.dtype)
            x_even, x_odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K // 2, 2]))
            acc = tl.dot(low, tl.trans(x_even), acc)
            acc = tl.dot(high, tl.trans(x_odd), acc)
        elif FLOAT_W:  # weights in x's dtype: the tile as loaded
            w = tl.load(
                w_rows + k + rk[None, :], mask=n_mask[:, None] & ((k + rk) < K)[None, :], other=0.0
            )
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            w = tl.load(
                w_rows + k + rk[None, :], mask=n_mask[:, None] & ((k + rk) < K)[None, :], other=0
            )
            acc = tl.dot(int8_as_float(w, x.dtype), tl.trans(x), acc)
    release_dependents(PDL)
    if FLOAT_W:
        y = acc
    else:
        y = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(
        y_ptr + rm[None, :] * stride_y + rn[:, None],
        y.to(y_ptr.dtype.element_ty),
        mask=n_mask[:, None] & m_mask[None, :],
    )


def weight_only_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y [M, N] in x's dtype for x [M, K] (unit stride along K) and an int8 [N, K] or packed int4 uint8 [N, K / 2]
    weight with fp32 row scales [N]."""
    return _gemm(x, weight, scale, bias)


def small_m_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] (unit stride along K) and weight [N, K] in x's dtype."""
    return _gemm(x, weight, None, bias)


def _gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    int4, float_w = weight.dtype == torch.uint8, scale is None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dummy = weight if float_w else scale  # unread pointers (no scale / no bias)
    args = (
        x,
        weight,
        dummy,
        bias if bias is not None else dummy,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        m_tile(m),
    )
    flags = dict(INT4=int4, FLOAT_W=float_w, HAS_BIAS=bias is not None)
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))  # noqa: E731
        _weight_only_gemm_kernel[grid](
            *args, **flags, **pdl_options(x.device, release_after_loop=True)
        )
    else:  # Triton's interpreter (CPU tests): one fixed config
        _weight_only_gemm_kernel.fn[(triton.cdiv(n, 16), triton.cdiv(m, 16))](
            *args, **flags, PDL=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32
        )
    return y
