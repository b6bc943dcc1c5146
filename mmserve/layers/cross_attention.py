"""Attention outside the KV cache: the cross-attention of Mllama's cross layers and of encoder-decoder families
(each sequence's query rows over its own encoder keys/values in the cross-attention pool), and batched
bidirectional multi-head attention of equal-length inputs (BLIP-2's Q-Former, Kosmos-2's latent queries)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.attention.metadata import CrossAttentionBatch


def attend_cross(
    q: torch.Tensor,
    cross: CrossAttentionBatch,
    layer: int,
    scale: float,
    masks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Cross-attention layer `layer` (its index among the family's cross-attention layers). q [R, H, D]: the rows
    of cross.seqs, in order -> [R, H, D]. The decodes (one row each, first) attend the first decode lengths of
    their pool blocks in one paged decode-attention launch; each other sequence attends its keys/values gathered
    from its blocks, under masks[j] [rows, tokens] (pool order; True = attend) for the j-th of them, if given."""
    cache = cross.caches[layer]
    d = cross.num_decodes
    out = torch.empty_like(q)
    if d:
        cross.backend.paged_attention(q[:d], cache, cross.decode_meta, scale, out=out[:d])
    if d < len(cross.seqs):
        seqs = []
        for j, s in enumerate(cross.seqs[d:]):
            kv = cache[:, s.block_table].flatten(1, 2)[:, : s.num_tokens]
            seqs.append(
                (s.rows.stop - s.rows.start, kv[0], kv[1], None if masks is None else masks[j])
            )
        out[d:] = attend_per_sequence(q[d:], seqs, scale)
    return out


def attend_per_sequence(
    q: torch.Tensor,
    seqs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    scale: float,
) -> torch.Tensor:
    """q [R, H, D] (the sequences' rows, in order); seqs: (rows, k [T, KVH, D], v [T, KVH, D], mask [rows, T] bool
    (True = attend) or None) per sequence -> [R, H, D]. Grouped heads (KVH < H) share their key/value head."""
    out = torch.empty_like(q)
    row = 0
    for n, k, v, mask in seqs:
        o = F.scaled_dot_product_attention(
            q[row : row + n].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=None if mask is None else mask[None, None],
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        out[row : row + n] = o[0].transpose(0, 1)
        row += n
    return out


def attend_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Bidirectional multi-head attention, scaled by head_dim^-0.5. q [N, Sq, H*D], k/v [N, Sk, H*D] -> [N, Sq, H*D]."""
    n, sq, width = q.shape
    d = width // heads
    q, k, v = (t.view(n, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5)
    return o.transpose(1, 2).reshape(n, sq, width)
