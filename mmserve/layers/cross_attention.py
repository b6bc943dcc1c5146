"""Attention outside the paged cache: each sequence's query rows over its own encoder keys/values (the cross-
attention of Mllama's cross layers and of encoder-decoder families, sequences padded together into few SDPA calls),
and batched bidirectional multi-head attention of equal-length inputs (BLIP-2's Q-Former, Kosmos-2's latent queries)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence


# the padded keys + values of one SDPA call over several sequences stay under this (more sequences: more calls)
PADDED_KV_MAX_BYTES = 256 * 2**20


def attend_per_sequence(q: torch.Tensor, seqs: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                        scale: float) -> torch.Tensor:
    """q [R, H, D] (the sequences' rows, in order); seqs: (rows, k [T, KVH, D], v [T, KVH, D], mask [rows, T] bool
    (True = attend) or None) per sequence -> [R, H, D]. Grouped heads (KVH < H) share their key/value head.

    Consecutive sequences are padded together (keys to the longest, rows to the most) into one SDPA call as long as
    their padded keys and values fit PADDED_KV_MAX_BYTES: a decode step of many sequences makes a few calls, not
    one per sequence per layer (the per-call host work, not the GPU, bounds those steps)."""
    out, row, group, group_bytes = [], 0, [], 0
    for seq in seqs:
        n, k = seq[0], seq[1]
        per_seq = 2 * k[0].numel() * k.element_size()   # bytes per key position of k and v
        longest = max([s[1].shape[0] for s in group] + [k.shape[0]])
        if group and (len(group) + 1) * longest * per_seq > PADDED_KV_MAX_BYTES:
            out.append(_attend_padded(q[row:row + group_bytes], group, scale))
            row, group, group_bytes = row + group_bytes, [], 0
        group.append(seq)
        group_bytes += n
    if group:
        out.append(_attend_padded(q[row:row + group_bytes], group, scale))
    return out[0] if len(out) == 1 else torch.cat(out)


def _attend_padded(q: torch.Tensor, seqs: list, scale: float) -> torch.Tensor:
    """One SDPA call over `seqs` padded to equal rows and keys (padding keys masked out; padding rows attend the
    first key and are dropped)."""
    if len(seqs) == 1:
        _, k, v, mask = seqs[0]
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=None if mask is None else mask[None, None], scale=scale,
                                           enable_gqa=k.shape[1] != q.shape[1])
        return o[0].transpose(0, 1)
    device, heads, dim = q.device, q.shape[1], q.shape[2]
    rows = [s[0] for s in seqs]
    lens = torch.tensor([s[1].shape[0] for s in seqs], device=device)
    num, max_rows = len(seqs), max(rows)
    k = pad_sequence([s[1] for s in seqs], batch_first=True)   # [B, T, KVH, D]
    v = pad_sequence([s[2] for s in seqs], batch_first=True)
    where = torch.cat([b * max_rows + torch.arange(n, device=device) for b, n in enumerate(rows)])
    padded = q.new_zeros(num * max_rows, heads, dim)
    padded[where] = q
    keys = torch.arange(k.shape[1], device=device)
    mask = (keys[None, :] < lens[:, None])[:, None, :].expand(num, max_rows, -1).clone()   # [B, rows, T]
    for b, (n, _, _, seq_mask) in enumerate(seqs):
        if seq_mask is not None:
            mask[b, :n, :seq_mask.shape[1]] = seq_mask
    mask[:, :, 0] |= (torch.arange(max_rows, device=device)[None, :] >= torch.tensor(rows, device=device)[:, None])
    o = F.scaled_dot_product_attention(padded.view(num, max_rows, heads, dim).transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
                                       enable_gqa=k.shape[2] != heads)
    return o.transpose(1, 2).reshape(num * max_rows, heads, dim)[where]


def attend_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Bidirectional multi-head attention, scaled by head_dim^-0.5. q [N, Sq, H*D], k/v [N, Sk, H*D] -> [N, Sq, H*D]."""
    n, sq, width = q.shape
    d = width // heads
    q, k, v = (t.view(n, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, scale=d ** -0.5)
    return o.transpose(1, 2).reshape(n, sq, width)
