"""Attention layer of a decoder: writes new K/V into its paged cache slice and attends over it."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.attention import torch_backend
from mmserve.attention.metadata import AttentionMetadata
from mmserve.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Backend-neutral paged attention. The runner binds `kv_cache` and picks `backend`."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = (
            num_heads,
            head_dim,
            num_kv_heads,
            scale,
        )
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, KVH, D]
        self.backend = torch_backend
        # FP8 KV cache scales (stored = value / scale); 1.0 unless a checkpoint or caller sets them
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rotary: nn.Module | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]. rotary(positions, q, k), if given, is applied first: in the
        same launch as the cache write where the backend has one (`write_kv_rotary`; 1D RoPE and M-RoPE on CUDA)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        fused = getattr(self.backend, "write_kv_rotary", None)
        if (
            rotary is not None
            and fused is not None
            and isinstance(rotary, RotaryEmbedding)
            and q.is_cuda
        ):
            q = fused(
                positions,
                q,
                k,
                v,
                self.kv_cache,
                meta.slot_mapping,
                rotary.cos,
                rotary.sin,
                self.k_scale,
                self.v_scale,
                axis=rotary.axis,
            )
        else:
            if rotary is not None:
                q, k = rotary(positions, q, k)
            self.backend.write_kv(
                k, v, self.kv_cache, meta.slot_mapping, self.k_scale, self.v_scale
            )
        return self.backend.paged_attention(
            q, self.kv_cache, meta, self.scale, self.k_scale, self.v_scale
        ).flatten(1)
