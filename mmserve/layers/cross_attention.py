"""Attention of each sequence's query rows over its own encoder keys/values (not in the paged cache): the cross-
attention of Mllama's cross layers and of encoder-decoder families, one SDPA call per sequence."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attend_per_sequence(q: torch.Tensor, seqs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                        scale: float) -> torch.Tensor:
    """q [R, H, D] (the sequences' rows, in order); seqs: (rows, k [T, KVH, D], v [T, KVH, D], mask [rows, T] bool
    (True = attend) or None) per sequence -> [R, H, D]. Grouped heads (KVH < H) share their key/value head."""
    out = torch.empty_like(q)
    row = 0
    for n, k, v, mask in seqs:
        o = F.scaled_dot_product_attention(
            q[row:row + n].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=None if mask is None else mask[None, None], scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        out[row:row + n] = o[0].transpose(0, 1)
        row += n
    return out
