"""AttentionMetadata: where each sequence's queries and keys live for one step (built by the runner); the
cross-attention inputs of families whose text attends the encoder's states instead of placeholder tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CrossAttentionSeq:
    """One sequence of the step that has media: its rows of the flat batch, the positions they hold, and the
    encoder's output per item (in prompt order; what a cross-attention layer attends, e.g. its keys/values)."""

    rows: slice                    # its rows [start, stop) of the step's flat batch
    start: int                     # the position of its first row
    prompt_len: int
    items: list                    # its MultiModalItems (offsets, encoder inputs), in prompt order
    states: list[torch.Tensor]     # the encoder's output for each item


@dataclass
class CrossAttentionBatch:
    """The step's sequences with media; rows of other sequences skip the cross-attention layers."""

    seqs: list[CrossAttentionSeq] = field(default_factory=list)


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
    # families with cross-attention layers (Mllama): the step's sequences with media; None for all others
    cross: CrossAttentionBatch | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1
