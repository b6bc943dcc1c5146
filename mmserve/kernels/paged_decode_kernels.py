"""Split-K decode attention over the paged KV cache (one new query per sequence), in Triton.

Two kernels, chosen per launch from host shapes by `decode_tile` (kernels/paged_decode.py):
- `_decode_kernel` (tensor cores): one program per (sequence, KV head, split) serves the KV head's GROUP query
  heads as rows of a tile padded to 16; scores and P·V are `tl.dot`s with an online softmax.
- `_decode_rows_kernel` (CUDA cores), for one query head per KV head from 8 sequences: each row of the key tile
  keeps its own softmax state (max, sum, accumulator) across the loop and the rows are merged once at the end,
  so the loop has no cross-thread reduction but the dot over head_dim. With a single real query row the
  tensor-core kernel spends 15/16 of its softmax work on padding and moves fp8 values into the tensor cores'
  layout a byte at a time; on an H100 this one reads an fp8 cache at 2.8 instead of 2.4 TB/s (docs/benchmarks.md),
  and an fp16 cache as fast or faster (up to 10 % at batch 16).
Partitions of a split sequence are merged by `_decode_reduce_kernel` by their log-sum-exp weights.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mmserve.kernels.paged_attention import _load_kv_tile, _online_softmax_step
from mmserve.kernels.pdl import wait_for_previous


@triton.jit
def _partition(seq_lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr):
    """(seq_len, first key tile, last key tile + 1) of this program's split-K partition of sequence seq."""
    seq_len = tl.load(seq_lens_ptr + seq)  # 0 for CUDA-graph padding rows: no tiles, zero output
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    return seq_len, tile_lo, tl.minimum(tile_lo + tiles_per_split, num_tiles)


@triton.jit
def _partition_lse(m, l):
    """Base-2 log-sum-exp of a partition's scores from its running max m and sum l; -inf if it saw no key."""
    return tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))


# the block-table width changes from step to step outside CUDA graphs: not specialized on (a new value class
# would compile a new variant mid-serving)
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
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
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Tensor cores: one program = one sequence x one KV head x one split; it serves all GROUP query heads of
    that KV head (as rows of a 16-row tile, at least)."""
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len, tile_lo, tile_hi = _partition(seq_lens_ptr, seq, split, num_splits, BLOCK_N)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    head = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m = tl.full([GROUP_PAD], -1e30, tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        tok = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tok_mask = tok < seq_len
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            tok,
            tok_mask,
            kvh,
            d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        m, l, acc = _online_softmax_step(q, k, v, tok_mask[None, :], m, l, acc, qk_scale, PREC)

    o = acc * (v_scale / tl.where(l > 0, l, 1.0))[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        row = (seq * tl.num_programs(1) * GROUP + head) * num_splits + split  # part_lse [B, H, S]
        tl.store(part_lse_ptr + row, _partition_lse(m, l), mask=g_mask)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
    else:
        tl.store(
            out_ptr + seq * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=o_mask,
        )


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_rows_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    bias_ptr,
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
    stride_bias,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):
    """CUDA cores: one program = one head (its own KV head) x one sequence x one split. Key-tile row r folds
    keys r, r + BLOCK_N, r + 2 BLOCK_N, ... into its own (m, l, acc); the BLOCK_N states merge at the end.
    HAS_BIAS: a score bias by the key's distance from the query, bias_ptr [heads, distances] fp32 (T5).
    Heads are the grid's fastest dimension: programs running side by side read the neighbouring head-major runs
    of the same cache blocks (on an H100, 2.96 instead of 2.91 TB/s at batch 256, 780 tokens, fp8)."""
    wait_for_previous(PDL)
    head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len, tile_lo, tile_hi = _partition(seq_lens_ptr, seq, split, num_splits, BLOCK_N)
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q = (
        tl.load(q_ptr + seq * stride_qt + head * stride_qh + d, mask=d_mask, other=0.0).to(
            tl.float32
        )
        * qk_scale
    )

    m = tl.full([BLOCK_N], -1e30, tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, D_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        tok = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tok_mask = tok < seq_len
        k, v = _load_kv_tile(
            k_cache_ptr,
            v_cache_ptr,
            bt_row,
            tok,
            tok_mask,
            head,
            d,
            d_mask,
            stride_cb,
            stride_cs,
            stride_ch,
            BLOCK_SIZE,
        )
        s = tl.sum(k.to(tl.float32) * q[None, :], 1)
        if HAS_BIAS:  # in the base-2 exponent's units, like qk_scale
            s += (
                tl.load(
                    bias_ptr + head * stride_bias + (seq_len - 1 - tok), mask=tok_mask, other=0.0
                )
                * 1.4426950408889634
            )
        s = tl.where(tok_mask, s, float("-inf"))
        m_new = tl.maximum(m, s)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new)
        l = l * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
        m = m_new

    m_all = tl.max(m, 0)
    # a row that saw no key keeps m = -1e30 and gets weight 0; when none did (seq_len 0) l_all = 0: zero output
    w = tl.exp2(m - m_all)
    l_all = tl.sum(l * w, 0)
    o = tl.sum(acc * w[:, None], 0) * (v_scale / tl.where(l_all > 0, l_all, 1.0))
    if SPLIT:
        row = (seq * tl.num_programs(0) + head) * num_splits + split  # part_lse [B, H, S]
        tl.store(part_lse_ptr + row, _partition_lse(m_all, l_all))
        tl.store(part_out_ptr + row * HEAD_DIM + d, o, mask=d_mask)
    else:
        tl.store(
            out_ptr + seq * stride_ot + head * stride_oh + d,
            o.to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the split-K partials of one (sequence, head) by their log-sum-exp weights."""
    wait_for_previous(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    row = (seq * tl.num_programs(1) + head) * num_splits + s
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty (seq_len 0)
    w = tl.exp2(lse - lse_max)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    den = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d,
        o.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )
