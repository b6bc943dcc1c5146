"""The paged KV cache tensor: its logical shape, and the memory order behind it.

Every kernel and backend indexes the cache as [2, num_blocks, block_size, num_kv_heads, head_dim] through
its strides. In memory it is head-major inside each block, [2, num_blocks, num_kv_heads, block_size,
head_dim]: one KV head's keys of a block are one contiguous run (2 KiB for 16 tokens x 128 dims of fp8)
instead of 16 runs of one token's head_dim bytes spread num_kv_heads x head_dim apart, so decode attention
reads whole runs of DRAM rather than 128-byte pieces.
"""

from __future__ import annotations

import torch


def new_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    head_major: bool = True,
) -> torch.Tensor:
    """A zeroed cache of logical shape [2, num_blocks, block_size, num_kv_heads, head_dim] (head_major:
    stored [2, num_blocks, num_kv_heads, block_size, head_dim]; False: stored as indexed)."""
    if not head_major:
        return torch.zeros(
            2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
    return torch.zeros(
        2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device
    ).transpose(2, 3)
