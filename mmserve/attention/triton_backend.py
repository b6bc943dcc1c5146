"""The `triton` attention backend: the torch backend's interface on the paged-attention Triton kernels.

Decode-only steps go to the split-K decode kernel, all others (prefill chunks, mixed batches) to the
varlen prefill kernel. No host syncs: only device tensors and the host ints already in the metadata,
so a decode step can be captured in a CUDA graph (keep block_tables' width fixed between replays).
"""
from __future__ import annotations

import torch

from mmserve.attention.metadata import AttentionMetadata
from mmserve.kernels import paged_attention as kernels


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store this step's keys/values. k, v [T, KVH, D]; kv_cache [2, num_blocks, block_size, KVH, D].

    Slots < 0 (padding tokens) are skipped. k_scale / v_scale: an FP8 cache's scales (attention/kv_quant.py).
    """
    kernels.reshape_and_cache(k, v, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys. q [T, H, D] -> out [T, H, D]."""
    # Decode kernel maps row i to sequence i, so it needs exactly one query row per sequence.
    if meta.max_query_len == 1 and q.shape[0] == meta.seq_lens.shape[0]:
        return kernels.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                              k_scale=k_scale, v_scale=v_scale)
    return kernels.paged_prefill_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                           meta.max_query_len, scale, k_scale=k_scale, v_scale=v_scale)
