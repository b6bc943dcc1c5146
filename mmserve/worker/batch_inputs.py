"""Host-side layout of one step's flat inputs: KV cache slots of each request's chunk, the leading decodes of a
mixed batch, rotary positions (plain or M-RoPE) concatenated over the batch, and the step's AttentionMetadata."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from mmserve.attention.metadata import AttentionMetadata
from mmserve.core.transfer import to_device


def slot_ids(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV cache slots of a sequence's token positions [start, end), given its block table: one range per
    block instead of one Python expression per token (a 2048-token chunk is 128 ranges)."""
    out: list[int] = []
    for i in range(start // block_size, (end - 1) // block_size + 1):
        base = block_ids[i] * block_size
        out += range(
            base + max(start - i * block_size, 0), base + min(end - i * block_size, block_size)
        )
    return out


def num_leading_decodes(query_start_loc: list[int]) -> int:
    """How many sequences at the front of the batch have exactly one query token."""
    return _leading_ones(np.diff(np.asarray(query_start_loc, dtype=np.int64)))


def _leading_ones(query_lens: np.ndarray) -> int:
    longer = np.flatnonzero(query_lens != 1)
    return int(longer[0]) if len(longer) else len(query_lens)


def padded_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """Block tables -> [B, longest] int32 on the host, padded with block 0: one copy of the ids in C and a masked
    store, not a padded Python list per sequence."""
    lens = np.fromiter(map(len, block_tables), np.int64, len(block_tables))
    width = int(lens.max()) if len(lens) else 0
    out = np.zeros((len(block_tables), width), np.int32)
    out[np.arange(width) < lens[:, None]] = np.fromiter(
        chain.from_iterable(block_tables), np.int32, int(lens.sum())
    )
    return torch.from_numpy(out)


def cat_positions(parts: list, mrope: bool) -> torch.Tensor:
    """Per-request positions (ranges and 1-D int64 arrays, for M-RoPE meaning all three axes, or [3, n] tensors;
    [1, n] tensors of a family's own 1-D positions) -> [T], or [3, T] for M-RoPE, int64 on the host."""
    if not mrope:
        return torch.from_numpy(
            np.concatenate([_flat(r) for r in parts]).astype(np.int64, copy=False)
        )
    out = np.empty((3, sum(_num_positions(r) for r in parts)), dtype=np.int64)
    i = 0
    for r in parts:
        n = _num_positions(r)
        if isinstance(r, torch.Tensor):
            out[:, i : i + n] = r.numpy()
        elif not isinstance(r, range):  # an array: the same on every axis
            out[:, i : i + n] = r
        elif n == 1:  # a decode: one column
            out[:, i] = r.start
        else:
            out[:, i : i + n] = np.arange(r.start, r.stop)
        i += n
    return torch.from_numpy(out)


def _num_positions(part) -> int:
    return part.shape[-1] if isinstance(part, (torch.Tensor, np.ndarray)) else len(part)


def _flat(part) -> np.ndarray:
    """A part of cat_positions as a 1-D array (a [1, n] tensor's row)."""
    if isinstance(part, torch.Tensor):
        return part[0].numpy()
    return np.arange(part.start, part.stop) if isinstance(part, range) else part


def token_positions(starts: list[int], qsl: list[int]) -> np.ndarray:
    """[T] int64 positions of sequences whose tokens sit at start, start + 1, ... (sequence i's rows start at
    qsl[i]): arange(T) shifted per sequence."""
    at = np.asarray(qsl, dtype=np.int64)
    shift = np.asarray(starts, dtype=np.int64) - at[:-1]
    return np.arange(qsl[-1], dtype=np.int64) + np.repeat(shift, np.diff(at))


def range_positions(starts: list[int], qsl: list[int], mrope: bool) -> torch.Tensor:
    """token_positions as [T] int64, or [3, T] for M-RoPE (the same on every axis), on the host."""
    return positions_tensor(token_positions(starts, qsl), mrope)


def positions_tensor(flat: np.ndarray, mrope: bool) -> torch.Tensor:
    """[T] int64 positions as the model takes them: [T], or [3, T] for M-RoPE (the same on every axis)."""
    return torch.from_numpy(np.broadcast_to(flat, (3, len(flat))).copy() if mrope else flat)


def table_slots(
    block_table: np.ndarray,
    rows: np.ndarray,
    qsl: list[int],
    positions: np.ndarray,
    block_size: int,
) -> list[int]:
    """KV cache slots of a batch's tokens at `positions` (token_positions), sequence i's (rows qsl[i] ..
    qsl[i + 1]) from its row rows[i] of `block_table`: one gather for the whole batch."""
    seq_rows = np.repeat(rows, np.diff(np.asarray(qsl, dtype=np.int64)))
    blocks = block_table[seq_rows, positions // block_size].astype(np.int64)
    return (blocks * block_size + positions % block_size).tolist()


def attention_metadata(
    block_tables: list[list[int]],
    slots: list[int],
    qsl: list[int],
    seq_lens: list[int],
    block_size: int,
    device: torch.device,
    slot_mapping: torch.Tensor | None = None,
    padded: np.ndarray | None = None,
) -> AttentionMetadata:
    """The step's AttentionMetadata: query offsets, context lengths and block tables (padded with block 0) on the
    device (copied without a host sync), their host copies, and the leading decodes' count; `slot_mapping`, when
    given, is a persistent buffer the caller fills (the piecewise graphs' own); `padded`: block_tables already
    padded ([B, longest] int32, FlatBatch.padded_tables)."""
    tables = padded_tables(block_tables) if padded is None else torch.from_numpy(padded)
    query_lens = np.diff(np.asarray(qsl, dtype=np.int64))
    return AttentionMetadata(
        query_start_loc=to_device(qsl, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_tables=to_device(tables, torch.int32, device),
        slot_mapping=to_device(slots, torch.int64, device)
        if slot_mapping is None
        else slot_mapping,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        num_decodes=_leading_ones(query_lens),
    )
