"""Rotary embedding and the paged KV cache write in one launch (`rotary_and_cache`).

A decode step of a 32-layer model otherwise launches the rotary kernel and the cache write 32 times each;
both are a few microseconds of launch and tail latency over a few kilobytes. Here one program per token
rotates the token's query heads (in place, or into a given buffer) and writes its rotated keys and its values
straight into the cache (keys are only ever read from the cache afterwards, so the rotated keys are not stored
back). 1D RoPE and M-RoPE (positions [3, T], fused_ops.rotary_angles) alike. It
rounds where the two unfused kernels round: the rotation to the activation dtype, then the cache's
conversion (fp8: scaled by 1 / scale, saturated), so the cache holds the same bits either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fp8_format import FP8_MAX, cache_scales, is_fp8
from mmserve.kernels.fused_ops import _rotate, rotary_angles, rotary_position_args
from mmserve.kernels.paged_attention import store_to_cache
from mmserve.kernels.pdl import pdl_options, wait_for_previous


# M-RoPE positions' row stride follows the step's token count outside graphs: not specialized on (each new
# value class would compile a variant mid-serving)
@triton.jit(do_not_specialize=["stride_axis"])
def _rotary_cache_kernel(
    pos_ptr,
    stride_axis,
    axis_ptr,
    slot_ptr,
    q_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    cos_ptr,
    sin_ptr,
    inv_k_scale,
    inv_v_scale,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    num_heads,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    QH_PAD: tl.constexpr,
    KH_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
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
        q_out_ptr,
        t,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        num_heads,
        cos,
        sin,
        HALF,
        QH_PAD,
        HALF_PAD,
    )

    slot = tl.load(slot_ptr + t).to(tl.int64)
    c = tl.arange(0, HALF_PAD)[None, :]
    h = tl.arange(0, KH_PAD)[:, None]
    mask = (h < NUM_KV_HEADS) & (c < HALF) & (slot >= 0)  # slot -1: padding row, nothing stored
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + c
    k_row = k_ptr + t * stride_kt + h * stride_kh + c
    k1 = tl.load(k_row, mask=mask, other=0.0)
    k2 = tl.load(k_row + HALF, mask=mask, other=0.0)
    k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
    store_to_cache(
        k_cache_ptr + dst, (k1f * cos - k2f * sin).to(k1.dtype), inv_k_scale, mask, QUANT, QMAX
    )
    store_to_cache(
        k_cache_ptr + dst + HALF,
        (k2f * cos + k1f * sin).to(k1.dtype),
        inv_k_scale,
        mask,
        QUANT,
        QMAX,
    )
    v_row = v_ptr + t * stride_vt + h * stride_vh + c
    v1 = tl.load(v_row, mask=mask, other=0.0)
    v2 = tl.load(v_row + HALF, mask=mask, other=0.0)
    store_to_cache(v_cache_ptr + dst, v1, inv_v_scale, mask, QUANT, QMAX)
    store_to_cache(v_cache_ptr + dst + HALF, v2, inv_v_scale, mask, QUANT, QMAX)


def rotary_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_out: torch.Tensor | None = None,
    axis: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q [T, H, D] into q_out (default: q itself, in place) and store rotated k and v [T, KVH, D] into
    kv_cache at slot_mapping [T] (slots < 0 skipped). cos, sin, positions and axis as in
    fused_ops.apply_rotary_ (axis None: 1D RoPE, positions [T]; M-RoPE: positions [3, T] or [T]). Returns the
    rotated queries (q_out).

    Same results as fused_ops.apply_rotary_ followed by paged_attention.reshape_and_cache; k is left as given.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = q if q_out is None else q_out
    if (
        head_dim % 2
        or any(x.stride(-1) != 1 for x in (q, q_out, k, v, kv_cache, cos))
        or cos.stride() != sin.stride()
    ):
        raise ValueError(
            "rotary_and_cache needs an even head_dim, contiguous last dims and matching cos/sin"
        )
    if q_out.shape != q.shape:
        raise ValueError(f"q_out {tuple(q_out.shape)} must have the shape of q {tuple(q.shape)}")
    if num_tokens == 0:
        return q_out
    k_scale, v_scale = cache_scales(kv_cache.dtype, k_scale, v_scale)
    stride_axis, axis, mrope = rotary_position_args(positions, axis)
    kc, vc = kv_cache[0], kv_cache[1]
    half = head_dim // 2
    _rotary_cache_kernel[(num_tokens,)](
        positions,
        stride_axis,
        axis,
        slot_mapping,
        q,
        q_out,
        k,
        v,
        kc,
        vc,
        cos,
        sin,
        1.0 / k_scale,
        1.0 / v_scale,
        q.stride(0),
        q.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        QH_PAD=triton.next_power_of_2(num_heads),
        KH_PAD=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=kv_cache.shape[2],
        QUANT=is_fp8(kv_cache.dtype),
        QMAX=FP8_MAX,
        MROPE=mrope,
        **pdl_options(q.device),
    )
    return q_out
