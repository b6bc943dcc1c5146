"""FlatBatch: the sequences a step computes, laid out as the flat token lists the model runs on.

`flatten` walks the scheduled chunks once: input ids, positions, KV cache slots, query offsets and context lengths,
plus the rows whose input token the previous step sampled on the device and the host does not have yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.core.transfer import to_device
from mmserve.worker.batch_inputs import cat_positions, slot_ids


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

    @property
    def block_tables(self) -> list[list[int]]:
        return [s.block_ids for s in self.seqs]

    @property
    def one_token_each(self) -> bool:
        """Every sequence computes one token and none of them is a picture's (a decode graph can run it)."""
        return len(self.input_ids) == len(self.seqs) and not any(
            s.request.mm_items_in(s.start, s.end) for s in self.seqs
        )


def flatten(seqs: list, prev, block_size: int, device: torch.device, mrope: bool) -> FlatBatch:
    """Lay out `seqs` (ScheduledSeq); `prev` is the launched step whose samples fill placeholder inputs."""
    input_ids: list[int] = []
    positions, slots, qsl, seq_lens = [], [], [0], []
    fill_dst, fill_src = [], []
    for s in seqs:
        req = s.request
        if s.end > req.num_known_tokens:
            if prev is None or prev.tokens is None or s.end - req.num_known_tokens != 1:
                raise RuntimeError(f"{req.request_id}: its input tokens are not known yet")
            fill_dst.append(len(input_ids) + s.num_tokens - 1)
            fill_src.append(req.last_sample_row)
        input_ids += req.token_ids(s.start, s.end)
        positions.append(req.positions(s.start, s.end))
        slots += slot_ids(s.block_ids, s.start, s.end, block_size)
        qsl.append(qsl[-1] + s.num_tokens)
        seq_lens.append(s.end)
    fill = None
    if fill_dst:
        fill = (
            to_device(fill_dst, torch.int64, device),
            prev.tokens[to_device(fill_src, torch.int64, device)],
        )
    return FlatBatch(
        list(seqs),
        input_ids,
        cat_positions(positions, mrope),
        slots,
        qsl,
        seq_lens,
        fill,
        [i for i, s in enumerate(seqs) if s.samples],
    )
