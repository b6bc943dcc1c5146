"""AttentionMetadata: where each sequence's queries and keys live for one step (built by the runner)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Batch layout of one forward pass over B sequences and T new tokens.

    Sequence i owns queries [query_start_loc[i], query_start_loc[i+1]) of the flat batch; its keys
    are the first seq_lens[i] positions of its blocks (cached prefix + this step's tokens).
    """

    query_start_loc: torch.Tensor    # [B + 1] int32, on device
    seq_lens: torch.Tensor           # [B] int32, on device: context length after this step
    block_tables: torch.Tensor       # [B, max_blocks] int32, on device (padded with 0)
    slot_mapping: torch.Tensor       # [T] int64, on device: cache slot of each new token
    query_start_loc_cpu: list[int]   # host copies, for loops and shape decisions
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # the first num_decodes sequences have one query each (the scheduler puts decodes first); a backend may
    # run them through its decode kernel and the rest through its prefill kernel. 0: no such split.
    num_decodes: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1
