"""FlatBatch: the sequences a step computes, laid out as the flat token lists the model runs on.

`flatten` walks the scheduled chunks once: input ids, positions, KV cache slots, query offsets and context lengths,
plus the rows whose input token the previous step sampled on the device and the host does not have yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmserve.core.transfer import to_device
from mmserve.worker.batch_inputs import cat_positions, range_positions, slot_ids


@dataclass
class FlatBatch:
    """One step's (or one part of a step's) sequences, in row order."""

    seqs: list  # ScheduledSeq, as the scheduler ordered them
    input_ids: list[int]
    positions: torch.Tensor  # [T] or [3, T] (M-RoPE) int64 on the host
    slots: list[int]  # KV cache slot of each token
    qsl: list[int]  # query start offsets, len(seqs) + 1
    seq_lens: list[int]  # context length of each sequence after this step
    # (rows, ids) on the device: input ids the previous step sampled, not yet on the host
    fill: tuple[torch.Tensor, torch.Tensor] | None
    sampling: list[int]  # indices into seqs of the sequences that sample a token
    # indices into seqs of the chunks with prompt tokens (start < prompt length): the only ones with pictures,
    # prompt ends or prompt logits, a few of a mixed step's hundreds of sequences
    prompt_chunks: list[int]
    # [B, longest] int32 host block tables padded with 0, gathered from the scheduler's persistent array (None:
    # the sequences have no rows in one; attention_metadata pads block_tables itself)
    padded_tables: np.ndarray | None = None

    @property
    def block_tables(self) -> list[list[int]]:
        return [s.block_ids for s in self.seqs]

    @property
    def one_token_each(self) -> bool:
        """Every sequence computes one token and none of them is a picture's (a decode graph can run it)."""
        seqs = self.seqs
        return len(self.input_ids) == len(seqs) and not any(
            seqs[i].request.mm_items_in(seqs[i].start, seqs[i].end) for i in self.prompt_chunks
        )


def flatten(
    seqs: list,
    prev,
    block_size: int,
    device: torch.device,
    mrope: bool,
    block_table: np.ndarray | None = None,
) -> FlatBatch:
    """Lay out `seqs` (ScheduledSeq); `prev` is the launched step whose samples fill placeholder inputs;
    `block_table`: SchedulerOutput.block_table, the rows of the sequences' block ids.

    One pass over the sequences with a short path for a decode (one generated token: its id, its slot from its
    block table); the positions of a batch whose requests all count theirs from 0 are one array op, and the
    padded block tables one gather from `block_table`."""
    input_ids: list[int] = []
    slots: list[int] = []
    qsl, seq_lens, starts, sampling, prompt_chunks = [0], [], [], [], []
    parts = None  # per-request positions, once a request brings its own (M-RoPE, a family's own)
    fill_dst, fill_src = [], []
    for i, s in enumerate(seqs):
        req, start, end = s.request, s.start, s.end
        num_prompt = len(req.prompt_token_ids)
        out = req.output_token_ids
        if end > num_prompt + len(out) - req.num_pending:
            if (
                prev is None
                or prev.tokens is None
                or end - num_prompt - len(out) + req.num_pending != 1
            ):
                raise RuntimeError(f"{req.request_id}: its input tokens are not known yet")
            fill_dst.append(len(input_ids) + end - start - 1)
            fill_src.append(req.last_sample_row)
        if end - start == 1 and start >= num_prompt:
            input_ids.append(out[start - num_prompt])
            slots.append(s.block_ids[start // block_size] * block_size + start % block_size)
        else:
            input_ids += req.token_ids(start, end)
            slots += slot_ids(s.block_ids, start, end, block_size)
        if parts is None and req.prompt_positions is not None:
            parts = [range(st, st + qsl[j + 1] - qsl[j]) for j, st in enumerate(starts)]
        if parts is not None:
            parts.append(req.positions(start, end))
        starts.append(start)
        qsl.append(len(input_ids))
        seq_lens.append(end)
        if s.samples:
            sampling.append(i)
        if start < num_prompt:
            prompt_chunks.append(i)
    fill = None
    if fill_dst:
        fill = (
            to_device(fill_dst, torch.int64, device),
            prev.tokens[to_device(fill_src, torch.int64, device)],
        )
    if parts is None:
        positions = range_positions(starts, qsl, mrope)
    else:
        positions = cat_positions(parts, mrope)
    return FlatBatch(
        list(seqs),
        input_ids,
        positions,
        slots,
        qsl,
        seq_lens,
        fill,
        sampling,
        prompt_chunks,
        _gather_tables(seqs, block_table),
    )


def _gather_tables(seqs: list, block_table: np.ndarray | None) -> np.ndarray | None:
    """The sequences' rows of `block_table`, as wide as the longest table (None without rows for all)."""
    if block_table is None or not seqs:
        return None
    rows = [s.block_row for s in seqs]
    if min(rows) < 0:
        return None
    return block_table[rows, : max(len(s.block_ids) for s in seqs)]
