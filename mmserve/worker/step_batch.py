"""FlatBatch: the sequences a step computes, laid out as the flat token lists the model runs on.

`flatten` lays out the leading decodes (one generated token each, the scheduler's first sequences: nearly all
of a mixed step's hundreds) with a few list comprehensions over them, then walks the prompt chunks after them one
by one: input ids, query offsets and context lengths, plus the rows whose input token the previous step sampled on
the device and the host does not have yet; positions and KV cache slots are array ops over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmserve.core.transfer import to_device
from mmserve.worker.batch_inputs import (
    cat_positions,
    positions_tensor,
    slot_ids,
    table_slots,
    token_positions,
)

# an output id whose step is still running on the device (async scheduling; Request.add_pending): the step's
# inputs take it from the previous step's samples
PLACEHOLDER = -1


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


@dataclass
class _Layout:
    """flatten's lists as it builds them (sequence i's rows are qsl[i] .. qsl[i + 1])."""

    input_ids: list[int]
    qsl: list[int]
    seq_lens: list[int]
    starts: list[int]
    sampling: list[int]
    fill_dst: list[int]
    fill_src: list[int]
    slots: list[int] | None  # built here only for sequences without rows in a block table


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

    The leading decodes are laid out by comprehensions over them, the chunks after them one by one; the
    positions of a batch whose requests all count theirs from 0 are one array op, and with `block_table` the
    slots of all tokens and the padded block tables are one gather each."""
    rows = _block_rows(seqs, block_table)
    num_decodes = _num_leading_decodes(seqs)
    layout = _decodes(seqs[:num_decodes], prev, block_size if rows is None else None)
    prompt_chunks = _chunks(layout, seqs, num_decodes, prev, block_size)
    own = any(s.request.prompt_positions is not None for s in seqs)
    # each token's position in its sequence: its rotary position unless its request has its own
    flat = None if own and rows is None else token_positions(layout.starts, layout.qsl)
    positions = (
        _own_positions(seqs, num_decodes, layout.starts, mrope)
        if own
        else positions_tensor(flat, mrope)
    )
    slots = (
        layout.slots
        if rows is None
        else table_slots(block_table, rows, layout.qsl, flat, block_size)
    )
    return FlatBatch(
        list(seqs),
        layout.input_ids,
        positions,
        slots,
        layout.qsl,
        layout.seq_lens,
        _fill(layout, prev, device),
        layout.sampling,
        prompt_chunks,
        None if rows is None else _gather_tables(seqs, block_table, rows),
    )


def _block_rows(seqs: list, block_table: np.ndarray | None) -> np.ndarray | None:
    """The sequences' rows of `block_table` (None without a table, or when a sequence has no row)."""
    if block_table is None or not seqs:
        return None
    rows = np.fromiter([s.block_row for s in seqs], np.int64, len(seqs))
    return None if rows.min() < 0 else rows


def _num_leading_decodes(seqs: list) -> int:
    """How many sequences at the front compute one generated token each (the scheduler puts them first)."""
    n = 0
    for s in seqs:
        if s.num_tokens != 1 or s.start < len(s.request.prompt_token_ids):
            break
        n += 1
    return n


def _decodes(seqs: list, prev, slots_block_size: int | None) -> _Layout:
    """The layout of decodes (one generated token each): their ids, offsets and the rows to fill from `prev`'s
    samples (and, given slots_block_size, their slots from their block ids)."""
    reqs = [s.request for s in seqs]
    starts = [s.start for s in seqs]
    ids = [r.output_token_ids[st - len(r.prompt_token_ids)] for r, st in zip(reqs, starts)]
    # a placeholder input is the previous step's sample (pending ids are the last ones of the output)
    waiting = [i for i, t in enumerate(ids) if t == PLACEHOLDER]
    if waiting:
        _check_fillable([reqs[i] for i in waiting], [starts[i] for i in waiting], prev)
    slots = None
    if slots_block_size is not None:
        bs = slots_block_size
        slots = [s.block_ids[st // bs] * bs + st % bs for s, st in zip(seqs, starts)]
    return _Layout(
        ids,
        list(range(len(seqs) + 1)),
        [st + 1 for st in starts],
        starts,
        [i for i, s in enumerate(seqs) if s.samples],
        waiting,
        [reqs[i].last_sample_row for i in waiting],
        slots,
    )


def _check_fillable(reqs: list, starts: list[int], prev) -> None:
    """Decodes whose input token is still a placeholder: it must be the oldest one, sampled by `prev`."""
    if prev is not None and prev.tokens is not None:
        # with one pending id, the placeholder at start is it; otherwise count
        bad = [r for r, st in zip(reqs, starts) if r.num_pending != 1 and r.num_known_tokens != st]
        if not bad:
            return
        reqs = bad
    raise RuntimeError(f"{reqs[0].request_id}: its input tokens are not known yet")


def _chunks(layout: _Layout, seqs: list, first: int, prev, block_size: int) -> list[int]:
    """Append seqs[first:] (prompt chunks, and any other chunk after the leading decodes) to `layout`, one by
    one; returns the indices of those with prompt tokens."""
    input_ids, qsl, slots = layout.input_ids, layout.qsl, layout.slots
    prompt_chunks = []
    for i in range(first, len(seqs)):
        s = seqs[i]
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
            layout.fill_dst.append(len(input_ids) + end - start - 1)
            layout.fill_src.append(req.last_sample_row)
        if end - start == 1 and start >= num_prompt:
            input_ids.append(out[start - num_prompt])
        else:
            input_ids += req.token_ids(start, end)
        if slots is not None:
            slots += slot_ids(s.block_ids, start, end, block_size)
        layout.starts.append(start)
        qsl.append(len(input_ids))
        layout.seq_lens.append(end)
        if s.samples:
            layout.sampling.append(i)
        if start < num_prompt:
            prompt_chunks.append(i)
    return prompt_chunks


def _own_positions(seqs: list, num_decodes: int, starts: list[int], mrope: bool) -> torch.Tensor:
    """Positions of a batch where some request brings its own (M-RoPE, a family's own 1-D ones): the decodes'
    (start + the request's delta), then each later chunk's (Request.positions)."""
    decode_reqs = [s.request for s in seqs[:num_decodes]]
    shift = [r.position_delta if r.prompt_positions is not None else 0 for r in decode_reqs]
    parts: list = [np.asarray(starts[:num_decodes], dtype=np.int64) + shift]
    parts += [s.request.positions(s.start, s.end) for s in seqs[num_decodes:]]
    return cat_positions(parts, mrope)


def _fill(layout: _Layout, prev, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, ids) on the device of the inputs the previous step sampled, or None."""
    if not layout.fill_dst:
        return None
    return (
        to_device(layout.fill_dst, torch.int64, device),
        prev.tokens[to_device(layout.fill_src, torch.int64, device)],
    )


def _gather_tables(seqs: list, block_table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The sequences' rows of `block_table`, as wide as the longest table."""
    return block_table[rows, : max(map(len, [s.block_ids for s in seqs]))]
