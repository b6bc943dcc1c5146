"""Triton kernels of W8A8 int8 (layers/w8a8_linear.py's arithmetic): per-token activation quantization and int8 x
int8 products with the scales applied in the epilogue.

- `quant_rows_int8`: one program per row finds max|x| (or takes a given one: a tensor-parallel rank's slice of
  longer rows), then writes round(x / scale) as int8 and the fp32 scale, bit for bit as the torch reference (IEEE
  divisions, round half to even): one launch, one read of x when the row fits one tile (up to 32k features).
- `int8_gemm`: y [M, N] = xs[m] * ws[n] * (xq @ wq^T)[m, n] (+ bias) on the int8 tensor cores, int32 accumulation
  (exact), the scales, bias and cast to the model's dtype in the epilogue: no padding of small M, no int32 product
  in memory. The operands are swapped as in kernels/weight_only_gemm.py (each program computes a [BLOCK_N, BLOCK_M]
  tile of y^T = W x^T): for decode's few rows the weight tile is the wide side, so narrow BLOCK_N tiles spread even
  N = 4096 over every SM while the K loop streams the weights. Past SMALL_M rows the tiles are square-ish.
- `int_mm_scaled`: cuBLAS's int8 GEMM (`torch._int_mm`, M > 16, K and N multiples of 8) and one epilogue kernel
  for the scales and bias: the large-M alternative that layers/w8a8_linear.py times against `int8_gemm` per shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.m_tiles import m_tile, prune_m_tiles
from mmserve.kernels.pdl import pdl_options, release_dependents, wait_for_previous

INT8_MAX = 127.0  # as layers/w8a8_linear.py's reference
AMAX_FLOOR = 1e-12  # a zero row gets scale 1e-12 / 127 and values 0
_QMAX = tl.constexpr(INT8_MAX)
_FLOOR = tl.constexpr(AMAX_FLOOR)
# 1.5 * 2^23: (y + it) - it rounds an fp32 |y| < 2^22 to an integer, half to even
_ROUND_MAGIC = tl.constexpr(12582912.0)

# BLOCK_N is the tensor cores' M side (operands swapped); int8 K tiles of 128-512 bytes per row.
_SMALL_M_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm in (16, 32, 64)
    for bn, bk, w, st in [
        (64, 256, 4, 4),
        (64, 512, 4, 3),
        (128, 256, 8, 3),
        (128, 128, 4, 4),
        (32, 256, 4, 4),
        (32, 512, 4, 3),
        (16, 512, 4, 3),
        (64, 128, 4, 5),
    ]
]
_LARGE_M_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [
        (128, 128, 8, 3),
        (128, 128, 4, 4),
        (256, 128, 8, 3),
        (128, 64, 4, 4),
        (64, 128, 4, 4),
    ]
]


def gemm_configs(m: int) -> list[triton.Config]:
    """`int8_gemm`'s autotuning candidates for M rows."""
    return prune_m_tiles(_SMALL_M_CONFIGS + _LARGE_M_CONFIGS, {"M": m})


@triton.jit
def _round_half_even(y):
    """fp32 y (|y| < 2^22) rounded to an integer value as torch.round does; no libdevice (the interpreter has none)."""
    return (y + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def store_int8_row(q_row, s_ptr, row, x, cols, mask, amax):
    """Row x (fp32, whole row in registers, masked lanes 0) as int8 at q_row and its scale at s_ptr[row], with the
    reference's operations; for a kernel that produces the row to quantize it on the way out (as fp8_gemm's
    `store_quantized_row` serves kernels/fused_ops.py)."""
    scale = tl.math.div_rn(tl.maximum(amax, _FLOOR), tl.full([], _QMAX, tl.float32))
    q = _round_half_even(tl.math.div_rn(x, scale))
    q = tl.minimum(tl.maximum(q, -_QMAX), _QMAX)
    tl.store(q_row + cols, q.to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _quant_rows_int8_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    amax_ptr,
    K,
    stride_x,
    stride_q,
    GIVEN_AMAX: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if ONE_PASS:  # the whole row in registers: one read
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        if GIVEN_AMAX:
            amax = tl.load(amax_ptr + row)
        else:
            amax = tl.max(tl.abs(x), axis=0)
        store_int8_row(q_row, s_ptr, row, x, rk, rk < K, amax)
    else:
        if GIVEN_AMAX:
            amax = tl.load(amax_ptr + row)
        else:
            amaxes = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                x = tl.load(x_row + k + rk, mask=(k + rk) < K, other=0.0).to(tl.float32)
                amaxes = tl.maximum(amaxes, tl.abs(x))
            amax = tl.max(amaxes, axis=0)
        for k in range(0, K, BLOCK_K):
            mask = (k + rk) < K
            x = tl.load(x_row + k + rk, mask=mask, other=0.0).to(tl.float32)
            store_int8_row(q_row + k, s_ptr, row, x, rk, mask, amax)


def quant_rows_int8(
    x: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], fp32 scales [M]) for x [M, K] (unit stride along K), as w8a8_linear.quantize_rows_int8: each
    row scaled so that its max |x| (or `amax` [M] fp32) maps to 127, rounded half to even."""
    m, k = x.shape
    assert x.stride(1) == 1, "activations must be contiguous along K"
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    block_k = min(triton.next_power_of_2(k), 32768 if x.is_cuda else 64)
    warps = 4 if block_k <= 2048 else 8 if block_k <= 8192 else 16
    if m:
        amax_arg = amax.float().contiguous() if amax is not None else s
        _quant_rows_int8_kernel[(m,)](
            x,
            q,
            s,
            amax_arg,
            k,
            x.stride(0),
            q.stride(0),
            GIVEN_AMAX=amax is not None,
            ONE_PASS=block_k >= k,
            BLOCK_K=block_k,
            num_warps=warps,
            **pdl_options(x.device),
        )
    return q, s


@triton.jit
def _scaled_epilogue(acc, rn, rm, n_mask, m_mask, xs_ptr, ws_ptr, b_ptr, HAS_BIAS: tl.constexpr):
    """fp32 y^T [BLOCK_N, BLOCK_M] = acc (int32) * xs[m] * ws[n] (+ bias[n]), in the reference's order."""
    xs = tl.load(xs_ptr + rm, mask=m_mask, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
    y = acc.to(tl.float32) * xs[None, :] * ws[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return y


@triton.autotune(
    configs=_SMALL_M_CONFIGS + _LARGE_M_CONFIGS,
    key=["M_TILE", "N", "K"],
    prune_configs_by={"early_config_prune": prune_m_tiles},
    do_bench=bench_ms,
)
@triton.jit
def _int8_gemm_kernel(
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
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask, n_mask = rm < M, rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = (
        xq_ptr + rm[None, :].to(tl.int64) * stride_x + rk[:, None]
    )  # x^T [BLOCK_K, BLOCK_M], K-major
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + rk) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
        x = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0)
        acc = tl.dot(w, x, acc, out_dtype=tl.int32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    release_dependents(PDL)
    y = _scaled_epilogue(acc, rn, rm, n_mask, m_mask, xs_ptr, ws_ptr, b_ptr, HAS_BIAS)
    tl.store(
        y_ptr + rm[None, :].to(tl.int64) * stride_y + rn[:, None],
        y.to(y_ptr.dtype.element_ty),
        mask=n_mask[:, None] & m_mask[None, :],
    )


def int8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """y [M, N] in out_dtype = xs[m] * ws[n] * (xq [M, K] @ weight [N, K]^T) (+ bias), both int8 with unit stride
    along K, xs fp32 [M], weight_scale fp32 [N]; the int32 sum is exact. `config`: one of gemm_configs(M) instead
    of the autotuner's choice."""
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == k
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    args = (
        xq,
        xs,
        weight,
        weight_scale,
        bias if bias is not None else weight_scale,
        y,
        m,
        n,
        k,
        xq.stride(0),
        weight.stride(0),
        y.stride(0),
        m_tile(m),
    )
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))  # noqa: E731
    pdl = pdl_options(xq.device, release_after_loop=True)
    if config is not None:
        _int8_gemm_kernel.fn[grid(config.kwargs)](
            *args, HAS_BIAS=bias is not None, **config.all_kwargs(), **pdl
        )
    elif xq.is_cuda:
        _int8_gemm_kernel[grid](*args, HAS_BIAS=bias is not None, **pdl)
    else:  # Triton's interpreter (CPU tests): one fixed config
        _int8_gemm_kernel.fn[(triton.cdiv(n, 16), triton.cdiv(m, 16))](
            *args, HAS_BIAS=bias is not None, PDL=0, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32
        )
    return y


@triton.jit
def _epilogue_kernel(
    acc_ptr,
    xs_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_acc,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    mask = n_mask[:, None] & m_mask[None, :]
    acc = tl.load(acc_ptr + rm[None, :].to(tl.int64) * stride_acc + rn[:, None], mask=mask, other=0)
    y = _scaled_epilogue(acc, rn, rm, n_mask, m_mask, xs_ptr, ws_ptr, b_ptr, HAS_BIAS)
    tl.store(
        y_ptr + rm[None, :].to(tl.int64) * stride_y + rn[:, None],
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


def int_mm_scaled(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`int8_gemm` through cuBLAS (`torch._int_mm`: M > 16, K and N multiples of 8) plus one epilogue kernel."""
    acc = torch._int_mm(xq, weight.t())
    m, n = acc.shape
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    grid = (triton.cdiv(n, 128), triton.cdiv(m, 16))
    _epilogue_kernel[grid](
        acc,
        xs,
        weight_scale,
        bias if bias is not None else weight_scale,
        y,
        m,
        n,
        acc.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=16,
        BLOCK_N=128,
    )
    return y
