"""AttentionMetadata: where each sequence's queries and keys live for one step (built by the runner); the
cross-attention inputs of families whose text attends the encoder's states instead of placeholder tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CrossAttentionSeq:
    """One sequence of the step that has media: its rows of the flat batch, the positions they hold, and where
    its encoder keys/values are in the cross-attention pool (worker/cross_kv.py)."""

    rows: slice  # its rows [start, stop) of the step's flat batch
    start: int  # the position of its first row
    prompt_len: int
    items: list  # its MultiModalItems (offsets, encoder inputs), in prompt order
    block_table: (
        torch.Tensor | None
    )  # [blocks] int64, on device: its pool blocks (None: one of the decodes)
    num_tokens: int  # encoder tokens it holds in them
    # pool position p holds column order[p] of its items' concatenated encoder outputs (None: the same order);
    # the family orders them so that the columns its generated tokens attend come first
    order: torch.Tensor | None = None


@dataclass
class CrossAttentionBatch:
    """The step's sequences with media; rows of other sequences skip the cross-attention layers.

    The first num_decodes of seqs hold one generated token each and attend the first decode_meta.seq_lens[i]
    tokens of their pool blocks, all through the backend's paged decode attention; the others attend theirs one
    sequence at a time."""

    seqs: list[CrossAttentionSeq] = field(default_factory=list)
    caches: list[torch.Tensor] = field(
        default_factory=list
    )  # the pool, one cache per cross-attention layer
    num_decodes: int = 0
    decode_meta: AttentionMetadata | None = None
    backend: Any = (
        None  # the attention backend module (attention/torch_backend.py or triton_backend.py)
    )


@dataclass
class AttentionMetadata:
    """Batch layout of one forward pass over B sequences and T new tokens.

    Sequence i owns queries [query_start_loc[i], query_start_loc[i+1]) of the flat batch; its keys
    are the first seq_lens[i] positions of its blocks (cached prefix + this step's tokens).
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, on device
    seq_lens: torch.Tensor  # [B] int32, on device: context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, on device (padded with 0)
    slot_mapping: torch.Tensor  # [T] int64, on device: cache slot of each new token
    query_start_loc_cpu: list[int]  # host copies, for loops and shape decisions
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # the first num_decodes sequences have one query each (the scheduler puts decodes first); a backend may
    # run them through its decode kernel and the rest through its prefill kernel. 0: no such split.
    num_decodes: int = 0
    # families with cross-attention layers (Mllama): the step's sequences with media; None for all others
    cross: CrossAttentionBatch | None = None
    # families with per-modality weights (FamilySpec.media_rows): [R] int64 rows of the flat batch that are
    # picture tokens; None when the step has none (decode steps, text, CUDA graphs)
    media_rows: torch.Tensor | None = None
    text_rows: torch.Tensor | None = None  # the other rows, with media_rows

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1
