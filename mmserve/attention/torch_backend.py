"""The `torch` attention backend: plain SDPA over keys gathered from the paged cache.

Readable and device-agnostic; it is the oracle the Triton kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmserve.attention.kv_quant import dequantize_kv, quantize_kv
from mmserve.attention.metadata import AttentionMetadata


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's keys/values. k, v [T, KVH, D]; kv_cache [2, num_blocks, block_size, KVH, D].

    k_scale / v_scale: the FP8 cache's per-layer scales (kv_quant.py); ignored by other cache dtypes.
    """
    block, offset = (
        slot_mapping // kv_cache.shape[2],
        slot_mapping % kv_cache.shape[2],
    )  # any memory order
    kv_cache[0][block, offset] = quantize_kv(k, kv_cache.dtype, k_scale)
    kv_cache[1][block, offset] = quantize_kv(v, kv_cache.dtype, v_scale)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    bias_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    distance_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys.

    q [T, H, D] -> out [T, H, D]. Query j of a sequence with q_len new tokens and context L sits at
    position L - q_len + j and sees keys 0..that position. out: where to write it (rows no sequence
    owns are left as they are); None allocates it. bias_fn(query positions [q_len], L) -> [H, q_len, L]: a score
    bias added before the softmax (T5's relative positions); only this backend takes one. distance_bias [H, N]: the
    same by the key's distance from the query (the Triton backend takes it for decodes).
    """
    if distance_bias is not None:

        def bias_fn(pos: torch.Tensor, ctx: int) -> torch.Tensor:
            return distance_bias[
                :, (pos[:, None] - torch.arange(ctx, device=pos.device)).clamp(min=0)
            ]

    out = torch.empty_like(q) if out is None else out
    bs = meta.block_size
    for i in range(meta.num_seqs):
        qs, qe = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        ctx = meta.seq_lens_cpu[i]
        q_len = qe - qs
        blocks = meta.block_tables[i, : (ctx + bs - 1) // bs]
        k = kv_cache[0, blocks].flatten(0, 1)[:ctx].transpose(0, 1)  # [KVH, ctx, D]
        v = kv_cache[1, blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        qi = q[qs:qe].transpose(0, 1)  # [H, q_len, D]
        mask = None
        if q_len > 1 or bias_fn is not None:
            pos = torch.arange(ctx - q_len, ctx, device=q.device)
        if q_len > 1:
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]  # [q_len, ctx]
        if bias_fn is not None:
            bias = bias_fn(pos, ctx).to(q.dtype)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        o = F.scaled_dot_product_attention(
            qi,
            dequantize_kv(k, q.dtype, k_scale),
            dequantize_kv(v, q.dtype, v_scale),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


# T5-style decoders take this backend's padded batch (`padded_attention`) for every step, decodes too
PREFERS_PADDED_BIAS = True
# a step's [sequences, heads, queries, keys] score bias above this many elements goes sequence by sequence instead
PADDED_BIAS_MAX_ELEMENTS = 1 << 25


@dataclass
class PaddedBatch:
    """A step's sequences padded to one query length and one key length (whole blocks), with the score bias and
    causal mask of every (query, key) pair built once for all layers: attention over the paged cache in a few
    batched calls instead of a loop over sequences (T5-style decoders, whose relative-position bias only this
    backend takes)."""

    rows: torch.Tensor  # [T] int64: each query's row in the padded [B * max_q] queries
    blocks: torch.Tensor  # [B, blocks] the sequences' block ids (padded columns masked out)
    mask: (
        torch.Tensor
    )  # [B, H, max_q, keys] additive: the bias, -inf where a query does not see a key
    max_q: int


def padded_batch(
    meta: AttentionMetadata, bias_fn: Callable[[torch.Tensor, int], torch.Tensor], heads: int
) -> PaddedBatch | None:
    """The padded layout of `meta`'s step and its masked bias (`bias_fn` as in `paged_attention`); None when the
    bias would exceed PADDED_BIAS_MAX_ELEMENTS (long prompts: `paged_attention` per sequence then)."""
    qsl, ctx = meta.query_start_loc_cpu, meta.seq_lens_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)]
    max_q, bs = max(q_lens), meta.block_size
    num_blocks = -(-max(ctx) // bs)
    keys = num_blocks * bs
    if meta.num_seqs * heads * max_q * keys > PADDED_BIAS_MAX_ELEMENTS:
        return None
    device = meta.block_tables.device
    j = torch.arange(max_q, device=device)
    q_len = torch.tensor(q_lens, device=device)
    # query j of sequence b sits at position ctx_b - q_len_b + j; padding rows (j >= q_len_b) look at key 0 only
    pos = (torch.tensor(ctx, device=device) - q_len)[:, None] + j[None, :]
    pos = torch.where(j[None, :] < q_len[:, None], pos, 0)
    bias = bias_fn(pos.flatten(), keys).view(heads, meta.num_seqs, max_q, keys).transpose(0, 1)
    causal = torch.arange(keys, device=device)[None, None, :] <= pos[:, :, None]
    rows = torch.cat([b * max_q + torch.arange(n, device=device) for b, n in enumerate(q_lens)])
    return PaddedBatch(
        rows,
        meta.block_tables[:, :num_blocks],
        bias.masked_fill(~causal[:, None], float("-inf")),
        max_q,
    )


def padded_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PaddedBatch,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`paged_attention` of a step laid out by `padded_batch`: q [T, H, D] -> [T, H, D]."""
    num_seqs, heads, dim = batch.blocks.shape[0], q.shape[1], q.shape[2]

    def gathered(part: int, kv_scale: float) -> torch.Tensor:  # [B, KVH, keys, D]
        kv = kv_cache[part][batch.blocks]
        return dequantize_kv(kv.flatten(1, 2), q.dtype, kv_scale).transpose(1, 2)

    padded = q.new_zeros(num_seqs * batch.max_q, heads, dim)
    padded[batch.rows] = q
    o = F.scaled_dot_product_attention(
        padded.view(num_seqs, batch.max_q, heads, dim).transpose(1, 2),
        gathered(0, k_scale),
        gathered(1, v_scale),
        attn_mask=batch.mask.to(q.dtype),
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(1, 2).reshape(-1, heads, dim)[batch.rows]
