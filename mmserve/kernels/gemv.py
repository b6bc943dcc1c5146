"""Triton GEMV for one-row activations (batch-1 decode): y[1, N] = x[1, K] @ W[N, K]^T (+ bias), also for
FP8 operands (e4m3 x and W with an x scale and per-row W scales, as kernels/fp8_gemm.py passes them), int8 weight
rows with per-row scales, and (`gemv_int4`) packed int4 rows (layers/weight_only.py).

A batch-1 decode step is a stream of weight reads; cuBLAS picks split-K GEMM tiles for M = 1 that
reach ~80 % of HBM bandwidth. This kernel gives each program BLOCK_N whole rows of W (contiguous in K),
keeps a [BLOCK_N, BLOCK_K] fp32 partial sum in registers and reduces it once at the end, so the loop
is nothing but wide loads. Block sizes are autotuned per (N, K) on first use (outside CUDA-graph capture:
the decode graphs warm up before they capture). `linear_one_row` also times cuBLAS once per shape and
keeps the faster of the two (kernels/fastest.py).

Each program reads its first weight tile before it waits for the previous kernel (programmatic dependent
launch, kernels/pdl.py; weights are never written during a forward pass), so that read overlaps the previous
kernel's tail: a batch-1 step is a chain of ~300 short kernels, and 128 of them are GEMVs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms, run_fastest
from mmserve.kernels.pdl import pdl_options, wait_for_previous

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bn, bk, w, s in [
        (4, 1024, 4, 3),
        (4, 1024, 4, 4),
        (4, 1024, 8, 3),
        (2, 2048, 4, 3),
        (4, 2048, 8, 3),
        (8, 512, 4, 3),
        (8, 1024, 8, 3),
        (8, 1024, 4, 4),
        (16, 512, 8, 3),
        (16, 256, 4, 4),
        (4, 512, 4, 4),
        (4, 2048, 4, 3),
        (8, 2048, 8, 3),
        (2, 4096, 8, 3),  # wider K tiles: 1-byte rows
        # one row per program: N = 4096 (down_proj) in 2-4 row blocks leaves 8-16
        # programs per SM, and the SMs that run one more than others set the time
        (1, 2048, 4, 3),
        (1, 4096, 8, 3),
        (1, 1024, 4, 4),
        (1, 2048, 8, 4),
    ]
]


@triton.jit
def _magic_float(u, DTYPE: tl.constexpr, OFFSET: tl.constexpr):
    """u (unsigned, < 1024) - OFFSET as exact DTYPE values, with no int-to-float conversion instructions (they run
    at a fraction of the FMA rate): u is OR-ed into the mantissa of 2^10 (fp16) or 2^23 (fp32), and that float less
    2^10 + OFFSET (2^23 + OFFSET) is u - OFFSET. bf16's 7-bit mantissa is too short: it goes through fp32. Measured
    faster in the tensor-core GEMM at 32 rows; in the one-row int4 GEMV one measurement had it slower than shifts and
    int-to-float instructions (docs/benchmarks.md, weight-only section)."""
    if DTYPE == tl.float16:
        return (u.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + OFFSET)
    else:
        f = (u.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)
        return f.to(DTYPE)


@triton.jit
def int8_as_float(q, DTYPE: tl.constexpr):
    """int8 values as exact DTYPE values: the byte's offset-binary form (sign bit flipped) is q + 128."""
    return _magic_float(q.to(tl.uint8, bitcast=True) ^ 0x80, DTYPE, 128)


@triton.jit
def int4_as_float(packed, DTYPE: tl.constexpr):
    """Bytes (uint8) of two two's-complement nibbles -> (low, high) as exact DTYPE values: each nibble with its
    top bit flipped is its value + 8."""
    offset = packed ^ 0x88
    return _magic_float(offset & 0xF, DTYPE, 8), _magic_float(offset >> 4, DTYPE, 8)


@triton.jit
def _row_values(w):
    """A weight tile as fp32 (int8 rows through int8_as_float)."""
    if w.dtype == tl.int8:
        return int8_as_float(w, tl.float32)
    else:
        return w.to(tl.float32)


@triton.autotune(configs=_CONFIGS, key=["N", "K"], do_bench=bench_ms)
@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    xs_ptr,
    ws_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    X_SCALED: tl.constexpr,
    W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    # Weights are never written during a forward pass: the first tile is read before waiting for the previous
    # kernel (PDL), so its HBM traffic overlaps that kernel's tail instead of following it. The second tile is
    # peeled too (its load is issued before the loop's); both measured best on an H100 (docs/benchmarks.md).
    w0 = tl.load(rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    wait_for_previous(PDL)
    w1 = tl.load(
        rows + BLOCK_K + rk[None, :], mask=n_mask[:, None] & (BLOCK_K + rk < K)[None, :], other=0.0
    )
    x0 = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + BLOCK_K + rk, mask=BLOCK_K + rk < K, other=0.0).to(tl.float32)
    acc = _row_values(w0) * x0[None, :] + _row_values(w1) * x1[None, :]
    for k in range(2 * BLOCK_K, K, BLOCK_K):
        k_mask = (k + rk) < K
        x = tl.load(x_ptr + k + rk, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rows + k + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += _row_values(w) * x[None, :]
    y = tl.sum(acc, axis=1)
    if X_SCALED:
        y = y * tl.load(xs_ptr)
    if W_SCALED:
        y = y * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.linear for x with one row ([K] or [1, K]); weight [N, K] with unit stride along K. With scales
    (FP8 operands; int8 weights take only weight_scale): y = x_scale * weight_scale[n] * (x @ weight^T)[n]
    (+ bias), summed in fp32; a scale left out is 1."""
    n, k = weight.shape
    assert x.numel() == k and weight.stride(1) == 1, (tuple(x.shape), tuple(weight.shape))
    x = x.contiguous()
    y = torch.empty(x.shape[:-1] + (n,), dtype=out_dtype or x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    args = (
        x,
        weight,
        bias if bias is not None else weight,
        y,
        x_scale if x_scale is not None else y,
        weight_scale if weight_scale is not None else y,
        n,
        k,
        weight.stride(0),
    )
    flags = dict(
        HAS_BIAS=bias is not None, X_SCALED=x_scale is not None, W_SCALED=weight_scale is not None
    )
    if x.is_cuda:
        _gemv_kernel[grid](*args, **flags, **pdl_options(x.device))
    else:  # Triton's interpreter (CPU tests) cannot time configs: one fixed config
        _gemv_kernel.fn[grid](*args, **flags, BLOCK_N=8, BLOCK_K=64, PDL=False)
    return y


@triton.autotune(configs=_CONFIGS, key=["N", "K"], do_bench=bench_ms)
@triton.jit
def _gemv_int4_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Packed int4 rows (two values per byte, low nibble first; layers/weight_only.py): BLOCK_K bytes per tile
    hold 2 * BLOCK_K weights, multiplied by the even and the odd elements of x (strided reads that L1 serves;
    splitting one contiguous read in registers measured slower)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_K)  # byte offsets in a row of K / 2 bytes
    n_mask = rn < N
    rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    half = K // 2
    # as in _gemv_kernel: the first weight tile is read before waiting for the previous kernel
    p0 = tl.load(rows + rb[None, :], mask=n_mask[:, None] & (rb < half)[None, :], other=0)
    wait_for_previous(PDL)
    x_even = tl.load(x_ptr + 2 * rb, mask=rb < half, other=0.0).to(tl.float32)
    x_odd = tl.load(x_ptr + 2 * rb + 1, mask=rb < half, other=0.0).to(tl.float32)
    low, high = int4_as_float(p0, tl.float32)
    acc = low * x_even[None, :] + high * x_odd[None, :]
    for b in range(BLOCK_K, half, BLOCK_K):
        b_mask = (b + rb) < half
        packed = tl.load(rows + b + rb[None, :], mask=n_mask[:, None] & b_mask[None, :], other=0)
        x_even = tl.load(x_ptr + 2 * (b + rb), mask=b_mask, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + 2 * (b + rb) + 1, mask=b_mask, other=0.0).to(tl.float32)
        low, high = int4_as_float(packed, tl.float32)
        acc += low * x_even[None, :] + high * x_odd[None, :]
    y = tl.sum(acc, axis=1) * tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_int4(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """gemv for packed int4 weights (uint8 [N, K / 2], unit stride along K): y = weight_scale[n] *
    (x @ unpack(weight)^T)[n] (+ bias), summed in fp32."""
    n, k = weight.shape[0], 2 * weight.shape[1]
    assert x.numel() == k and weight.stride(1) == 1, (tuple(x.shape), tuple(weight.shape))
    x = x.contiguous()
    y = torch.empty(x.shape[:-1] + (n,), dtype=out_dtype or x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    args = (
        x,
        weight,
        bias if bias is not None else weight_scale,
        y,
        weight_scale,
        n,
        k,
        weight.stride(0),
    )
    if x.is_cuda:
        _gemv_int4_kernel[grid](*args, HAS_BIAS=bias is not None, **pdl_options(x.device))
    else:  # Triton's interpreter (CPU tests): one fixed config
        _gemv_int4_kernel.fn[grid](
            *args, HAS_BIAS=bias is not None, BLOCK_N=8, BLOCK_K=32, PDL=False
        )
    return y


def linear_one_row(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear for a one-row CUDA activation by whichever of cuBLAS / gemv was faster for this shape."""
    return run_fastest(
        ("linear_one_row", weight.shape, weight.dtype, bias is not None, weight.device),
        [lambda: F.linear(x, weight, bias), lambda: gemv(x, weight, bias)],
    )
