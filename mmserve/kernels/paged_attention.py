"""Triton kernels over the paged KV cache: cache writes, varlen prefill attention, and the tile helpers the
decode kernels (kernels/paged_decode.py) share with it.

Cache layout: [2, num_blocks, block_size, num_kv_heads, head_dim], in the model's dtype or FP8 (e4m3) with
per-layer K and V scales (attention/kv_quant.py): writes quantize in-register, the attention kernels convert
tiles back to the query dtype and fold the scales into the softmax scale (K) and the output (V). Every launch
grid depends only on host ints that stay fixed for a CUDA graph (batch size, head counts, block-table
width), never on device data.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mmserve.kernels.fp8_format import FP8_MAX, cache_scales, is_fp8
from mmserve.kernels.pdl import pdl_options, wait_for_previous

# --------------------------------------------------------------------------------------------- helpers


@triton.jit
def _load_kv_tile(
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    tok,
    tok_mask,
    kvh,
    d,
    d_mask,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """Gather K and V [BLOCK_N, D_PAD] of token positions `tok` through one sequence's block table."""
    page = tl.load(block_table_ptr + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    off = page * stride_cb + (tok % BLOCK_SIZE) * stride_cs + kvh * stride_ch
    mask = tok_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, visible, m, l, acc, qk_scale, PREC: tl.constexpr):
    """One flash-attention step: fold keys/values [BLOCK_N, D] into the running (max, sum, acc) of q [M, D].

    Scores are kept in base 2 (qk_scale includes log2(e)). `m` starts at a finite -1e30 so that rows
    that see no key in a tile get p = 0 instead of NaN.
    """
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale  # [M, BLOCK_N] fp32
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
    return m_new, l, acc


# --------------------------------------------------------------------------------------------- cache write


@triton.jit
def store_to_cache(ptr, x, inv_scale, mask, QUANT: tl.constexpr, QMAX: tl.constexpr):
    """Store keys or values into the cache; an FP8 cache gets x / scale, saturated, rounded to nearest (as
    kv_quant.quantize_kv)."""
    if QUANT:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -QMAX), QMAX)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    inv_k_scale,
    inv_v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (
        (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    )  # slot -1: padding row
    dst = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_cs
        + h[:, None] * stride_ch
        + d[None, :]
    )
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    store_to_cache(k_cache_ptr + dst, k, inv_k_scale, mask, QUANT, QMAX)
    store_to_cache(v_cache_ptr + dst, v, inv_v_scale, mask, QUANT, QMAX)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store k, v [T, KVH, D] into kv_cache [2, num_blocks, block_size, KVH, D] at slot_mapping [T].

    Slots < 0 are padding (e.g. CUDA-graph padded batches) and are skipped. An FP8 cache stores
    k / k_scale and v / v_scale, saturated.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_scale, v_scale = cache_scales(kv_cache.dtype, k_scale, v_scale)
    _check_last_dim_contiguous(k, v, kv_cache)
    kc, vc = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        kc,
        vc,
        slot_mapping,
        1.0 / k_scale,
        1.0 / v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        QUANT=is_fp8(kv_cache.dtype),
        QMAX=FP8_MAX,
        **pdl_options(k.device),
    )


# --------------------------------------------------------------------------------------------- prefill / mixed


# a mixed step passes its prompts' rows as slices after the decodes' (block_tables[d:], seq_lens[d:], ...),
# whose 16-byte alignment follows the number of decodes: not specialized on, or each new alignment compiles a
# variant mid-serving (seen: two ~0.7 s stalls at concurrency 8 on a fresh Triton cache)
@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"],
)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program = one sequence x one KV head x BLOCK_M // GROUP of its new queries.

    The BLOCK_M rows are (query token, head of the group) pairs, so each K/V tile is loaded once per group.
    Query j of a sequence with q_len new tokens and context L is at position L - q_len + j.
    """
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    q_block = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first = q_block * TOKENS  # first query (within the sequence) of this program

    r = tl.arange(0, BLOCK_M)
    tok = first + r // GROUP
    head = kvh * GROUP + r % GROUP
    row_mask = (r < TOKENS * GROUP) & (tok < q_len)
    pos = seq_len - q_len + tok  # absolute position of each row's query
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Keys before the first query's position are visible to every row: no causal mask there.
    last = tl.minimum(first + TOKENS, q_len) - 1
    kv_end = tl.where(first < q_len, seq_len - q_len + last + 1, 0)
    kv_full = tl.where(first < q_len, (seq_len - q_len + first + 1) // BLOCK_N * BLOCK_N, 0)

    m = tl.full([BLOCK_M], -1e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, kv_full, BLOCK_N):
        kt = start + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kt,
            kt < kv_full,
            kvh,
            d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        m, l, acc = _online_softmax_step(
            q, k, v, (kt < kv_full)[None, :], m, l, acc, qk_scale, PREC
        )
    for start in range(kv_full, kv_end, BLOCK_N):
        kt = start + tl.arange(0, BLOCK_N)
        k_mask = kt < kv_end
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            kt,
            k_mask,
            kvh,
            d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        visible = k_mask[None, :] & (kt[None, :] <= pos[:, None])
        m, l, acc = _online_softmax_step(q, k, v, visible, m, l, acc, qk_scale, PREC)

    o = acc * (v_scale / tl.where(l > 0, l, 1.0))[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of variable-length query chunks over their cached prefix plus themselves.

    Handles prefill chunks and single-token decodes in one launch.

    Args:
        q: [T, H, D]; sequence i owns rows [query_start_loc[i], query_start_loc[i + 1]).
        kv_cache: [2, num_blocks, block_size, KVH, D], this step's keys already written.
        block_tables: [B, max_blocks] int32.
        seq_lens: [B] int32, context length after this step.
        query_start_loc: [B + 1] int32.
        max_query_len: host int, an upper bound of every sequence's new-token count (sizes the grid).
        scale: softmax scale.
        k_scale, v_scale: an FP8 cache's scales (1.0 for caches in the model's dtype).
        out: where to write the sequences' rows ([T, H, D], q's dtype, last dim contiguous; rows no sequence
            owns are left as they are); None allocates it with zeros.
    Returns:
        out [T, H, D] in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    if out is None:
        out = torch.zeros(
            q.shape, dtype=q.dtype, device=q.device
        )  # rows no sequence owns stay zero
    _check_last_dim_contiguous(q, kv_cache, out)
    k_scale, v_scale = cache_scales(kv_cache.dtype, k_scale, v_scale)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_m = max(64 if d_pad <= 128 else 32, triton.next_power_of_2(group))
    block_n = 64 if d_pad <= 128 else 32
    kc, vc = kv_cache[0], kv_cache[1]
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_m // group))
    _prefill_kernel[grid](
        q,
        kc,
        vc,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * k_scale * math.log2(math.e),
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PREC=_precision(q.dtype),
        num_warps=4,
        num_stages=2,
        **pdl_options(q.device),
    )
    return out


# --------------------------------------------------------------------------------------------- misc


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to TF32 on tensor cores; fp16/bf16 ignore this setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"expected a contiguous last dim, got strides {t.stride()}")
