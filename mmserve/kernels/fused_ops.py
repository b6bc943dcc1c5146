"""Triton fused elementwise ops of a decoder layer: RMSNorm (+ residual add), in-place rotary, SiLU-and-mul.

RMSNorm and SiLU-and-mul round where their torch layers round (layers/norm.py, activation.py), so results
match them. Rotary works in fp32 and rounds once; the torch layer (layers/rotary.py) rounds cos / sin and
each product to the input dtype, so the two can differ by an ulp in fp16 / bf16 (the kernel is the closer one).
RMSNorm and SiLU-and-mul can also hand their output to a W8A8 linear already quantized (`quantize=True`): e4m3
rows for an FP8 linear (one kernel instead of the op plus kernels/fp8_gemm.quant_rows) or, `rows_dtype=torch.int8`,
int8 rows for an int8 one (instead of kernels/int8_gemm.quant_rows_int8), with the same bits as those.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fp8_format import AMAX_FLOOR, FP8, FP8_MAX, QuantizedRows
from mmserve.kernels.fp8_gemm import store_quantized_row
from mmserve.kernels.int8_gemm import store_int8_row
from mmserve.kernels.pdl import pdl_options, wait_for_previous

_FP8_MAX, _FP8_FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(AMAX_FLOOR)


@triton.jit
def _store_rows(q_row, s_ptr, row, y, cols, mask, static_ptr, STATIC, INT8: tl.constexpr):
    """Row y (fp32, whole row, masked lanes 0) quantized on the way out: int8 as quant_rows_int8, else e4m3."""
    if INT8:
        store_int8_row(q_row, s_ptr, row, y, cols, mask, tl.max(tl.abs(y), axis=0))
    else:
        store_quantized_row(
            q_row, s_ptr, row, y, cols, mask, static_ptr, STATIC, _FP8_MAX, _FP8_FLOOR
        )


def _int8_rows(rows_dtype: torch.dtype, input_scale: torch.Tensor | None) -> bool:
    """Whether quantized rows are int8 (else e4m3); int8 rows are dynamic only (W8A8's per-token scales)."""
    assert rows_dtype in (FP8, torch.int8) and (rows_dtype == FP8 or input_scale is None)
    return rows_dtype == torch.int8


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    s_ptr,
    static_ptr,
    stride_x,
    stride_r,
    n,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    INT8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum rounded in x's dtype
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normed.to(x.dtype).to(tl.float32) * w
    if QUANT:  # the norm's output rounded to x's dtype (as unfused), then quantized for the linear
        y = y.to(x.dtype).to(tl.float32)
        _store_rows(out_ptr + row * n, s_ptr, row, y, cols, mask, static_ptr, STATIC, INT8)
    else:
        tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along the last dim (the kernels index rows by a stride and
    columns by position); a copy only where x's layout has no such view."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    quantize: bool = False,
    input_scale: torch.Tensor | None = None,
    rows_dtype: torch.dtype = FP8,
):
    """Like RMSNorm.forward: norm(x), or with residual (norm(x + residual), x + residual). x [T, hidden].

    quantize: return norm(x) as QuantizedRows for a W8A8 linear, exactly as the unfused output would be quantized:
    e4m3 as quantize_rows (per-row dynamic scales, or the static input_scale) or, rows_dtype int8, as
    quantize_rows_int8 (per-row dynamic); needs weight.dtype == x.dtype."""
    n = x.shape[-1]
    x2 = _unit_stride_rows(x)
    int8 = _int8_rows(rows_dtype, input_scale)
    if quantize:
        assert weight.dtype == x.dtype and x.dim() == 2, (
            "quantized RMSNorm takes [T, hidden] in the weight's dtype"
        )
    out_dtype = rows_dtype if quantize else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    scales = torch.empty(len(x2), dtype=torch.float32, device=x.device) if quantize else out
    res2 = _unit_stride_rows(residual) if residual is not None else x2
    res_out = (
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    )  # row-major
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2,
            res2,
            weight,
            out,
            res_out,
            scales,
            input_scale if input_scale is not None else scales,
            x2.stride(0),
            res2.stride(0),
            n,
            eps,
            HAS_RESIDUAL=residual is not None,
            QUANT=quantize,
            STATIC=input_scale is not None,
            BLOCK=block,
            INT8=int8,
            num_warps=4 if n <= 4096 else 8,
            **pdl_options(x.device),
        )
    y = QuantizedRows(out, scales, x.dtype) if quantize else out
    return y if residual is None else (y, res_out)


@triton.jit
def _rotate(
    x_ptr,
    out_ptr,
    t,
    stride_t,
    stride_h,
    out_stride_t,
    out_stride_h,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Rotate token t's heads of x into out (which may be x itself)."""
    h = tl.arange(0, H_PAD)[:, None]
    c = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (c < HALF)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + c, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + c, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    dst = out_ptr + t * out_stride_t + h * out_stride_h
    tl.store(dst + c, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(dst + HALF + c, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def rotary_angles(
    pos_ptr,
    t,
    stride_axis,
    axis_ptr,
    cos_ptr,
    sin_ptr,
    stride_cos,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    MROPE: tl.constexpr,
):
    """cos, sin [1, HALF_PAD] (fp32) of token t. 1D RoPE: every frequency turns with the position pos[t];
    M-RoPE: frequency c turns with position row axis[c] (positions [3, T], rows stride_axis apart)."""
    c = tl.arange(0, HALF_PAD)[None, :]
    if MROPE:
        axis = tl.load(axis_ptr + c, mask=c < HALF, other=0).to(tl.int64)
        pos = tl.load(pos_ptr + axis * stride_axis + t).to(tl.int64)
    else:
        pos = tl.load(pos_ptr + t).to(tl.int64)
    # only the first HALF columns are read: RotaryEmbedding's tables are [max_pos, D] = cat(freqs, freqs),
    # MRotaryEmbedding's [max_pos, D / 2]
    cos = tl.load(cos_ptr + pos * stride_cos + c, mask=c < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + c, mask=c < HALF, other=0.0).to(tl.float32)
    return cos, sin


def rotary_position_args(positions: torch.Tensor, axis: torch.Tensor | None) -> tuple:
    """(stride between position rows, axis table, MROPE) for kernels calling rotary_angles with positions.

    1D RoPE: positions [T], axis None. M-RoPE: axis [D / 2] (which of the 3 position rows drives each
    frequency) with positions [3, T], or [T] for text-only tokens (all three rows equal)."""
    if positions.stride(-1) != 1:
        raise ValueError("rotary positions need a contiguous last dim")
    if axis is None:
        if positions.dim() != 1:
            raise ValueError(f"1D rotary takes positions [T], got {tuple(positions.shape)}")
        return 0, positions, False  # the axis pointer is unused: any tensor does
    return positions.stride(0) if positions.dim() == 2 else 0, axis, True


# M-RoPE positions' row stride follows the step's token count outside graphs: not specialized on (each new
# value class would compile a variant mid-serving)
@triton.jit(do_not_specialize=["stride_axis"])
def _rotary_kernel(
    pos_ptr,
    stride_axis,
    axis_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    QH_PAD: tl.constexpr,
    KH_PAD: tl.constexpr,
    MROPE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = rotary_angles(
        pos_ptr, t, stride_axis, axis_ptr, cos_ptr, sin_ptr, stride_cos, HALF, HALF_PAD, MROPE
    )
    _rotate(
        q_ptr,
        q_ptr,
        t,
        stride_qt,
        stride_qh,
        stride_qt,
        stride_qh,
        num_heads,
        cos,
        sin,
        HALF,
        QH_PAD,
        HALF_PAD,
    )
    _rotate(
        k_ptr,
        k_ptr,
        t,
        stride_kt,
        stride_kh,
        stride_kt,
        stride_kh,
        num_kv_heads,
        cos,
        sin,
        HALF,
        KH_PAD,
        HALF_PAD,
    )


def apply_rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    axis: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, KVH, D] in place (half-split layout); returns (q, k).

    cos, sin: the rotary module's tables (scaling folded in), [max_pos, D] or [max_pos, D / 2]; positions and
    axis as in rotary_position_args (axis None: 1D RoPE).
    """
    num_tokens, num_heads, head_dim = q.shape
    if (
        q.stride(-1) != 1
        or k.stride(-1) != 1
        or cos.stride(-1) != 1
        or cos.stride() != sin.stride()
    ):
        raise ValueError("rotary needs contiguous last dims and matching cos/sin layouts")
    stride_axis, axis, mrope = rotary_position_args(positions, axis)
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions,
            stride_axis,
            axis,
            q,
            k,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            num_heads,
            k.shape[1],
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            QH_PAD=triton.next_power_of_2(num_heads),
            KH_PAD=triton.next_power_of_2(k.shape[1]),
            MROPE=mrope,
            **pdl_options(q.device),
        )
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    tl.store(out_ptr + row * d + cols, _silu_mul(x_ptr + row * stride_x, cols, mask, d), mask=mask)


@triton.jit
def _silu_mul(x_row, cols, mask, d):
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded like F.silu's output
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    static_ptr,
    stride_x,
    d,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    INT8: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    y = _silu_mul(x_ptr + row * stride_x, cols, mask, d).to(tl.float32)
    _store_rows(q_ptr + row * d, s_ptr, row, y, cols, mask, static_ptr, STATIC, INT8)


def silu_and_mul(
    x: torch.Tensor,
    quantize: bool = False,
    input_scale: torch.Tensor | None = None,
    rows_dtype: torch.dtype = FP8,
):
    """x [..., 2d] = [gate | up] -> silu(gate) * up [..., d].

    quantize: return it as QuantizedRows for a W8A8 linear (x [T, 2d]), quantized as rms_norm's are."""
    d = x.shape[-1] // 2
    x2 = _unit_stride_rows(x)
    int8 = _int8_rows(rows_dtype, input_scale)
    if quantize:
        q = torch.empty(len(x2), d, dtype=rows_dtype, device=x.device)
        scales = torch.empty(len(x2), dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(d)
        if len(x2):
            _silu_and_mul_quant_kernel[(len(x2),)](
                x2,
                q,
                scales,
                input_scale if input_scale is not None else scales,
                x2.stride(0),
                d,
                STATIC=input_scale is not None,
                BLOCK=block,
                INT8=int8,
                num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16,
                **pdl_options(x.device),
            )
        return QuantizedRows(q, scales, x.dtype)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), d, BLOCK=block, **pdl_options(x.device)
        )
    return out
