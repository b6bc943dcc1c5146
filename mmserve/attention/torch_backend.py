"""The `torch` attention backend: plain SDPA over keys gathered from the paged cache.

Readable and device-agnostic; it is the oracle the Triton kernels are tested against.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mmserve.attention.kv_quant import dequantize_kv, quantize_kv
from mmserve.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store this step's keys/values. k, v [T, KVH, D]; kv_cache [2, num_blocks, block_size, KVH, D].

    k_scale / v_scale: the FP8 cache's per-layer scales (kv_quant.py); ignored by other cache dtypes.
    """
    block, offset = slot_mapping // kv_cache.shape[2], slot_mapping % kv_cache.shape[2]   # any memory order
    kv_cache[0][block, offset] = quantize_kv(k, kv_cache.dtype, k_scale)
    kv_cache[1][block, offset] = quantize_kv(v, kv_cache.dtype, v_scale)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
                    bias_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys.

    q [T, H, D] -> out [T, H, D]. Query j of a sequence with q_len new tokens and context L sits at
    position L - q_len + j and sees keys 0..that position. out: where to write it (rows no sequence
    owns are left as they are); None allocates it. bias_fn(query positions [q_len], L) -> [H, q_len, L]: a score
    bias added before the softmax (T5's relative positions); only this backend takes one.
    """
    out = torch.empty_like(q) if out is None else out
    bs = meta.block_size
    for i in range(meta.num_seqs):
        qs, qe = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        ctx = meta.seq_lens_cpu[i]
        q_len = qe - qs
        blocks = meta.block_tables[i, : (ctx + bs - 1) // bs]
        k = kv_cache[0, blocks].flatten(0, 1)[:ctx].transpose(0, 1)   # [KVH, ctx, D]
        v = kv_cache[1, blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        qi = q[qs:qe].transpose(0, 1)                                 # [H, q_len, D]
        mask = None
        if q_len > 1 or bias_fn is not None:
            pos = torch.arange(ctx - q_len, ctx, device=q.device)
        if q_len > 1:
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]   # [q_len, ctx]
        if bias_fn is not None:
            bias = bias_fn(pos, ctx).to(q.dtype)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        o = F.scaled_dot_product_attention(qi, dequantize_kv(k, q.dtype, k_scale), dequantize_kv(v, q.dtype, v_scale),
                                           attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[qs:qe] = o.transpose(0, 1)
    return out
