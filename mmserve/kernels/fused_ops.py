"""Triton fused elementwise ops of a decoder layer: RMSNorm (+ residual add), in-place rotary, SiLU-and-mul.

Each rounds where its torch layer rounds (layers/norm.py, rotary.py, activation.py), so results match them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)   # sum rounded in x's dtype
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = normed.to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * n + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Like RMSNorm.forward: norm(x), or with residual (norm(x + residual), x + residual). x [..., hidden]."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(x) if residual is not None else out
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8,
        )
    return out if residual is None else (out, res_out)


@triton.jit
def _rotate(x_ptr, t, stride_t, stride_h, num_heads, cos, sin, HALF: tl.constexpr,
            H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    c = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (c < HALF)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + c, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + c, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + c, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(base + HALF + c, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_cos, num_heads, num_kv_heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   QH_PAD: tl.constexpr, KH_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)[None, :]
    # cos/sin caches are [max_pos, D] = cat(freqs, freqs): the first half holds every frequency
    cos = tl.load(cos_ptr + pos * stride_cos + c, mask=c < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + c, mask=c < HALF, other=0.0).to(tl.float32)
    _rotate(q_ptr, t, stride_qt, stride_qh, num_heads, cos, sin, HALF, QH_PAD, HALF_PAD)
    _rotate(k_ptr, t, stride_kt, stride_kh, num_kv_heads, cos, sin, HALF, KH_PAD, HALF_PAD)


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, KVH, D] in place (half-split layout); returns (q, k).

    positions [T]; cos, sin [max_pos, D] as in RotaryEmbedding (scaling folded in).
    """
    num_tokens, num_heads, head_dim = q.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary needs contiguous last dims and matching cos/sin layouts")
    half = head_dim // 2
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            num_heads, k.shape[1], HALF=half, HALF_PAD=triton.next_power_of_2(half),
            QH_PAD=triton.next_power_of_2(num_heads), KH_PAD=triton.next_power_of_2(k.shape[1]),
        )
    return q, k


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)        # rounded like F.silu's output
    tl.store(out_ptr + row * d + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> silu(gate) * up [..., d]."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, x2.stride(0), d, BLOCK=block)
    return out
