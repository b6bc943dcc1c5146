"""The cross-attention pool: the encoder keys/values of running requests of cross-attention families (Mllama's
image tiles, an encoder-decoder's encoder output), in paged blocks like the KV cache's.

TensorRT-LLM's cross KV cache: `cross_kv_cache_fraction` of the KV budget, blocks handed out by the scheduler
(engine/cross_blocks.py) when it admits a request, written once when the request's encoder runs and read by
every step after. One cache per cross-attention layer, each of the KV cache's format and memory order
(attention/kv_layout.py), so a step's generated tokens attend their sequences' encoder outputs in one paged
decode-attention launch per layer instead of one SDPA call per sequence per layer.
"""

from __future__ import annotations

import torch

from mmserve.core.transfer import cdiv, to_device
from mmserve.models.base import CrossKVLayout
from mmserve.worker.batch_inputs import slot_ids


class CrossKVPool:
    def __init__(
        self,
        layout: CrossKVLayout,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        """dtype: the model's (the encoder's outputs are written as they are, whatever its linears are stored in)."""
        self.layout, self.num_blocks, self.block_size = layout, num_blocks, block_size
        self.bytes_per_token = layout.bytes_per_token(dtype)
        shape = (layout.layers, 2, num_blocks, layout.kv_heads, block_size, layout.head_dim)
        # one tensor, head-major inside each block; indexed [layer, k/v, block, slot, head, dim]
        self.storage = torch.zeros(shape, dtype=dtype, device=device).transpose(3, 4)
        self.caches = list(
            self.storage.unbind(0)
        )  # layer l: [2, num_blocks, block_size, kv heads, head_dim]

    @staticmethod
    def blocks_for(
        layout: CrossKVLayout, dtype: torch.dtype, budget_bytes: int, block_size: int
    ) -> int:
        return int(budget_bytes // (layout.bytes_per_token(dtype) * block_size))

    def num_blocks_of(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def write(self, states: torch.Tensor, block_ids: list[int]) -> None:
        """Store one request's encoder keys/values, states [T, layers, 2, kv heads, head_dim], in its blocks."""
        t = len(states)
        if t > len(block_ids) * self.block_size:
            raise ValueError(
                f"{t} encoder tokens do not fit {len(block_ids)} blocks of {self.block_size}"
            )
        slots = to_device(
            slot_ids(block_ids, 0, t, self.block_size), torch.int64, self.storage.device
        )
        self.storage[:, :, slots // self.block_size, slots % self.block_size] = states.permute(
            1, 2, 0, 3, 4
        ).to(self.storage.dtype)
