"""The `triton` attention backend: the torch backend's interface on the paged-attention Triton kernels.

Decode-only steps go to the split-K decode kernel, prefill chunks to the varlen prefill kernel; a mixed
batch sends its leading one-query sequences (`meta.num_decodes`) to the decode kernel and the rest to the
prefill kernel (whose 64-row query tiles would hold a single real row for each decode). No host syncs: only device tensors and the host ints already in the metadata,
so a decode step can be captured in a CUDA graph (keep block_tables' width fixed between replays).
"""

from __future__ import annotations

import torch

from mmserve.attention.metadata import AttentionMetadata
from mmserve.kernels import paged_attention as kernels
from mmserve.kernels import paged_decode
from mmserve.kernels.rotary_cache import rotary_and_cache


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's keys/values. k, v [T, KVH, D]; kv_cache [2, num_blocks, block_size, KVH, D].

    Slots < 0 (padding tokens) are skipped. k_scale / v_scale: an FP8 cache's scales (attention/kv_quant.py).
    """
    kernels.reshape_and_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)


def write_kv_rotary(
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
    """Rotary embedding (rotates q into q_out, default q itself; returns the rotated queries) and write_kv of the
    rotated keys, in one launch; axis: M-RoPE's per-frequency position row (kernels/rotary_cache.py)."""
    return rotary_and_cache(
        positions, q, k, v, kv_cache, slot_mapping, cos, sin, k_scale, v_scale, q_out, axis
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    distance_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys. q [T, H, D] -> out [T, H, D].

    out: where to write it (rows no sequence owns are left as they are); None allocates it. distance_bias [H, N]
    fp32: a score bias by the key's distance from the query (T5's relative positions), decode-only steps only."""
    # Decode kernel maps row i to sequence i, so it needs exactly one query row per sequence.
    if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]:
        return paged_decode.paged_decode_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
            out=out,
            distance_bias=distance_bias,
        )
    if distance_bias is not None:
        raise ValueError("the triton backend takes a distance bias for decode-only steps only")
    d = meta.num_decodes
    if not 0 < d < meta.num_seqs:
        return kernels.paged_prefill_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
            out=out,
        )
    # query_start_loc holds absolute row offsets, so the prefill part takes the tail of every table as it is
    out = kernels.paged_prefill_attention(
        q,
        kv_cache,
        meta.block_tables[d:],
        meta.seq_lens[d:],
        meta.query_start_loc[d:],
        meta.max_query_len,
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out=out,
    )
    paged_decode.paged_decode_attention(
        q[:d],
        kv_cache,
        meta.block_tables[:d],
        meta.seq_lens[:d],
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
        out=out[:d],
    )
    return out
