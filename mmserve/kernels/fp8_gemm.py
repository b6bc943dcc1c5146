"""FP8 (e4m3) W8A8 matmul on the GPU, with the arithmetic of layers/fp8_linear.py.

- `quant_rows`: one Triton program per activation row finds max|x| (or takes the static scale), then
  writes the row in e4m3 and its scale: one read of x when the row fits one tile (up to 32k features;
  longer rows take a second pass), one fp8 write.
- `fp8_gemv`: one-row activations (batch-1 decode) are a stream of weight reads: kernels/gemv.py's GEMV over
  one-byte weights, so the step reads half the bytes of fp16.
  For one row the faster of it and the small-M GEMM is timed once per shape (kernels/fastest.py).
- `fp8_gemm_small_m`: up to SMALL_M rows (decode batches) a Triton tensor-core GEMM with narrow N tiles,
  so even N = 4096 spreads over every SM; cuBLASLt's FP8 kernels leave most SMs idle there (measured on
  an H100: o_proj at M = 8 took 2x the time of fp16).
- More rows go to `torch._scaled_mm` (cuBLASLt FP8 tensor cores) with row-wise scales: one scale per
  activation row, one per weight row, applied in the GEMM's epilogue; shapes cuBLASLt refuses (N or K not a
  multiple of 16) stay on the Triton GEMM. For fp16 / bf16 outputs it accumulates "fast", in the tensor
  cores' own ~14-bit accumulator without promoting partial sums to fp32, as the FP8 GEMMs of TensorRT-LLM and
  vLLM do: on an H100 at LLaVA-7B shapes (M 256-4096) that added a relative error of 1.3-2.6e-3 (rms; max
  3.5e-3 to 9.5e-3) to the product of the quantized operands, against 3.5e-2 (rms) that quantizing the
  activations and weights to e4m3 costs, and made a whole throughput run 3.9 % faster (docs/benchmarks.md).
  fp32 outputs (a model run in fp32) keep full fp32 accumulation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms, run_fastest
from mmserve.kernels.fp8_format import AMAX_FLOOR, FP8, FP8_MAX
from mmserve.kernels.fp8_gemv import SWAP_MAX_M, fp8_gemm_swap_ab, split_k_for
from mmserve.kernels.gemv import gemv
from mmserve.kernels.m_tiles import SMALL_M, m_tile, prune_m_tiles
from mmserve.kernels.pdl import pdl_options, wait_for_previous


@triton.jit
def _to_fp8(x, inv_scale, QMAX: tl.constexpr):
    """x * inv_scale saturated to the e4m3 range, still fp32 (inv_scale from _reciprocal: torch's bits)."""
    return tl.minimum(tl.maximum(x * inv_scale, -QMAX), QMAX)


@triton.jit
def _reciprocal(scale):
    """1 / scale with IEEE rounding, as torch's `1.0 / scale` (layers/fp8_linear.py quantize_rows)."""
    return tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    K,
    stride_x,
    stride_q,
    STATIC: tl.constexpr,
    ONE_PASS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if ONE_PASS:  # the whole row in registers: one read
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        store_quantized_row(q_row, s_ptr, row, x, rk, rk < K, static_ptr, STATIC, QMAX, FLOOR)
    else:
        if STATIC:
            scale = tl.load(static_ptr).to(tl.float32)
        else:
            amax = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                x = tl.load(x_row + k + rk, mask=(k + rk) < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0), FLOOR) / QMAX
        inv_scale = _reciprocal(scale)
        for k in range(0, K, BLOCK_K):
            mask = (k + rk) < K
            x = tl.load(x_row + k + rk, mask=mask, other=0.0).to(tl.float32)
            tl.store(
                q_row + k + rk, _to_fp8(x, inv_scale, QMAX).to(q_ptr.dtype.element_ty), mask=mask
            )
        tl.store(s_ptr + row, scale)


@triton.jit
def store_quantized_row(
    q_row,
    s_ptr,
    row,
    y,
    cols,
    mask,
    static_ptr,
    STATIC: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
):
    """Store one row y (fp32, whole row in registers; masked lanes 0) in e4m3 at q_row and its scale at
    s_ptr[row], as quant_rows does: scale = max|y| / 448 (or the static one), q = clamp(y * (1 / scale))."""
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), FLOOR) / QMAX
    tl.store(
        q_row + cols, _to_fp8(y, _reciprocal(scale), QMAX).to(q_row.dtype.element_ty), mask=mask
    )
    tl.store(s_ptr + row, scale)


def quant_rows(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 x [M, K], fp32 scales [M]) for x [M, K] with unit stride along K; as fp8_linear.quantize_rows."""
    m, k = x.shape
    assert x.stride(1) == 1, "activations must be contiguous along K"
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty(m, dtype=torch.float32, device=x.device)
    # GPU: a whole row per program up to 32k features (one read, no loop latency); the interpreter: small tiles
    block_k = min(triton.next_power_of_2(k), 32768 if x.is_cuda else 64)
    warps = 4 if block_k <= 2048 else 8 if block_k <= 8192 else 16
    if m:
        _quant_rows_kernel[(m,)](
            x,
            q,
            s,
            input_scale if input_scale is not None else s,
            k,
            x.stride(0),
            q.stride(0),
            STATIC=input_scale is not None,
            ONE_PASS=block_k >= k,
            BLOCK_K=block_k,
            QMAX=FP8_MAX,
            FLOOR=AMAX_FLOOR,
            num_warps=warps,
            **pdl_options(x.device),
        )
    return q, s


def fp8_gemv(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y [1, N] for one quantized row xq [1, K] (scale xs [1]) and an e4m3 weight [N, K] with row scales."""
    return gemv(xq, weight, bias, xs, weight_scale, out_dtype)


_SMALL_M_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm in (16, 32, 64)
    for bn, bk, w, st in [
        (32, 256, 4, 4),
        (64, 256, 4, 4),
        (32, 512, 4, 3),
        (64, 128, 4, 5),
        (128, 128, 4, 4),
        (128, 256, 8, 3),
        (16, 512, 4, 4),
        (64, 512, 8, 3),
    ]
]


@triton.autotune(
    configs=_SMALL_M_CONFIGS,
    key=["M_TILE", "N", "K"],
    prune_configs_by={"early_config_prune": prune_m_tiles},
    do_bench=bench_ms,
)
@triton.jit
def _fp8_gemm_kernel(
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
    x_ptrs = xq_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :]
    w_ptrs = (
        w_ptr + rn[None, :].to(tl.int64) * stride_w + rk[:, None]
    )  # W^T tile [BLOCK_K, BLOCK_N], K-major
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + rk) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        # Hopper's FP8 tensor cores accumulate with ~14 mantissa bits; fold into fp32 every 32 products
        acc = tl.dot(x, w, acc, max_num_imprecise_acc=32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    xs = tl.load(xs_ptr + rm, mask=m_mask, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=n_mask, other=0.0)
    y = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_y + rn[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def fp8_gemm_small_m(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y [M, N] for a few quantized rows xq [M, K] (scales xs [M]) and an e4m3 weight [N, K] with row scales."""
    m, k = xq.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
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
    if xq.is_cuda:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))  # noqa: E731
        _fp8_gemm_kernel[grid](*args, HAS_BIAS=bias is not None, **pdl_options(xq.device))
    else:  # Triton's interpreter (CPU tests): one fixed config
        _fp8_gemm_kernel.fn[(triton.cdiv(n, 16), triton.cdiv(m, 16))](
            *args, HAS_BIAS=bias is not None, PDL=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32
        )
    return y


def scaled_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """cuBLASLt e4m3 GEMM with row-wise scales: y [M, N] = (xs ⊗ ws) * (xq @ weight^T) (+ bias); fast
    accumulation unless the output is fp32 (module docstring)."""
    if out_dtype == torch.float32:  # full accumulation; cuBLASLt takes no bias with an fp32 output
        y = torch._scaled_mm(
            xq, weight.t(), scale_a=xs[:, None], scale_b=weight_scale[None, :], out_dtype=out_dtype
        )
        return y if bias is None else y + bias
    return torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=xs[:, None],
        scale_b=weight_scale[None, :],
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=True,
    )


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y [M, N] = W8A8 product of x [M, K] (fp16/bf16/fp32) and an e4m3 weight [N, K] with fp32 row scales."""
    xq, xs = quant_rows(x if x.stride(-1) == 1 else x.contiguous(), input_scale)
    return fp8_matmul_quantized(xq, xs, weight, weight_scale, bias, x.dtype)


def fp8_matmul_quantized(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """fp8_matmul of rows already quantized (xq [M, K] e4m3, xs [M] fp32); y in out_dtype."""
    if len(xq) <= SMALL_M:
        return run_fastest(
            (
                "fp8_few_rows",
                m_tile(len(xq)),
                weight.shape,
                bias is not None,
                out_dtype,
                weight.device,
            ),
            few_row_candidates(xq, xs, weight, weight_scale, bias, out_dtype),
        )
    if weight.shape[0] % 16 or weight.shape[1] % 16:  # cuBLASLt FP8 needs N, K % 16 == 0
        return fp8_gemm_small_m(xq, xs, weight, weight_scale, bias, out_dtype)
    return scaled_mm(xq, xs, weight, weight_scale, bias, out_dtype)


def few_row_candidates(
    xq: torch.Tensor,
    xs: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> list[Callable[[], torch.Tensor]]:
    """The interchangeable kernels for up to SMALL_M rows, the one taken before any timing first: the small-M
    GEMM; for one row the GEMV (it wins narrow or long rows: o_proj, down_proj); the swapped-operand tensor-core
    GEMM (kernels/fp8_gemv.py), and its split-K form where N gives it too few programs."""
    args = (xq, xs, weight, weight_scale, bias, out_dtype)
    found = [lambda: fp8_gemm_small_m(*args)]
    if len(xq) == 1:
        found.append(lambda: fp8_gemv(*args))
    if len(xq) <= SWAP_MAX_M:
        found.append(lambda: fp8_gemm_swap_ab(*args))
        split = split_k_for(*weight.shape)
        if split > 1:
            found.append(lambda: fp8_gemm_swap_ab(*args, split_k=split))
    return found
