"""worker/step_batch.flatten over random batches against a per-token reference: the leading decodes laid out over
the batch at once, and the slots of all tokens gathered from the scheduler's block-table rows, give what laying out
each sequence token by token gives (ids, positions with their own M-RoPE / delta positions, slots, offsets,
placeholder rows and which sequences sample)."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from mmserve.core.step import ScheduledRequest
from mmserve.engine.request import PLACEHOLDER, Request
from mmserve.sampling_params import SamplingParams
from mmserve.worker.step_batch import flatten

BS = 4
CPU = torch.device("cpu")


def _reference(seqs: list[ScheduledRequest], prev_tokens: list[int] | None, mrope: bool) -> dict:
    """The layout token by token: the token ids (placeholders taken from the previous step's samples), each
    token's rotary position, its KV slot from the block ids, and the per-sequence lists."""
    ids, positions, slots, qsl, seq_lens, sampling, prompt_chunks = [], [], [], [0], [], [], []
    fill = []
    for i, s in enumerate(seqs):
        req = s.request
        tokens = req.prompt_token_ids + req.output_token_ids
        for p in range(s.start, s.end):
            if tokens[p] == PLACEHOLDER:
                fill.append((len(ids), prev_tokens[req.last_sample_row]))
            ids.append(tokens[p])
            slots.append(s.block_ids[p // BS] * BS + p % BS)
            positions.append(_position(req, p, mrope))
        qsl.append(len(ids))
        seq_lens.append(s.end)
        if s.samples:
            sampling.append(i)
        if s.start < req.num_prompt_tokens:
            prompt_chunks.append(i)
    return {
        "ids": ids,
        "positions": positions,
        "slots": slots,
        "qsl": qsl,
        "seq_lens": seq_lens,
        "sampling": sampling,
        "prompt_chunks": prompt_chunks,
        "fill": fill,
    }


def _position(req: Request, p: int, mrope: bool) -> list[int] | int:
    if req.prompt_positions is None:
        return [p] * 3 if mrope else p
    if p < req.num_prompt_tokens:
        column = req.prompt_positions[:, p].tolist()
        return column if mrope else column[0]
    return [p + req.position_delta] * 3 if mrope else p + req.position_delta


def _batch(
    rng: random.Random, mrope: bool, own_positions: bool
) -> tuple[list, np.ndarray, list[int]]:
    """Decodes (some with placeholder inputs, some with their own positions), then prompt chunks; a block table
    whose row r holds the block ids of the sequence given row r."""
    seqs, tables, next_block = [], [], 0
    prev_tokens = [rng.randrange(1000) for _ in range(64)]
    num_decodes, num_chunks = rng.randint(0, 12), rng.randint(0, 4)
    for i in range(num_decodes + num_chunks):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 20))]
        req = Request(f"r{i}", None, prompt, SamplingParams(max_tokens=64))
        if own_positions and rng.random() < 0.5:
            rows = 3 if mrope else 1
            req.prompt_positions = torch.tensor(
                [[rng.randrange(50) for _ in prompt] for _ in range(rows)]
            )
            req.position_delta = rng.randint(-5, 5)
        if i < num_decodes:
            req.output_token_ids = [rng.randrange(1, 1000) for _ in range(rng.randint(1, 10))]
            if rng.random() < 0.6:  # its input is the previous step's sample
                req.add_pending(rng.randrange(len(prev_tokens)))
            start, n = req.num_tokens - 1, 1
        else:
            start = rng.randrange(len(prompt))
            n = rng.randint(1, len(prompt) - start)
        num_blocks = (start + n + BS - 1) // BS
        blocks = list(range(next_block, next_block + num_blocks))
        rng.shuffle(blocks)
        next_block += num_blocks
        seqs.append(
            ScheduledRequest(req, start, n, blocks, start + n == req.num_tokens, block_row=i)
        )
        tables.append(blocks)
    width = max((len(t) for t in tables), default=1) + 2
    table = np.zeros((len(tables) + 3, width), dtype=np.int32)
    for row, t in enumerate(tables):
        table[row, : len(t)] = t
    return seqs, table, prev_tokens


@pytest.mark.parametrize("mrope", [False, True])
@pytest.mark.parametrize("own_positions", [False, True])
@pytest.mark.parametrize("with_rows", [False, True])
def test_flatten_matches_the_per_token_layout(mrope, own_positions, with_rows):
    rng = random.Random(hash((mrope, own_positions, with_rows)) % 1000)
    for _ in range(40):
        seqs, table, prev_tokens = _batch(rng, mrope, own_positions)
        if not seqs:
            continue
        prev = types.SimpleNamespace(tokens=torch.tensor(prev_tokens))
        batch = flatten(seqs, prev, BS, CPU, mrope, table if with_rows else None)
        want = _reference(seqs, prev_tokens, mrope)
        assert batch.input_ids == want["ids"]
        assert batch.slots == want["slots"]
        got_positions = batch.positions.tolist()
        assert (list(map(list, zip(*got_positions))) if mrope else got_positions) == want[
            "positions"
        ]
        assert batch.positions.dtype == torch.int64
        assert (batch.qsl, batch.seq_lens) == (want["qsl"], want["seq_lens"])
        assert (batch.sampling, batch.prompt_chunks) == (want["sampling"], want["prompt_chunks"])
        if want["fill"]:
            rows, ids = batch.fill
            assert list(zip(rows.tolist(), ids.tolist())) == want["fill"]
        else:
            assert batch.fill is None
        if with_rows:
            width = max(len(s.block_ids) for s in seqs)
            padded = [s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs]
            assert batch.padded_tables.tolist() == padded
        else:
            assert batch.padded_tables is None


def test_a_decode_whose_input_is_not_the_oldest_placeholder_is_refused():
    req = Request("a", None, [1, 2], SamplingParams(max_tokens=8))
    req.output_token_ids = [5]
    req.add_pending(0)
    req.add_pending(
        1
    )  # two steps in flight: position 4's input (position 3's id) is not sampled yet
    prev = types.SimpleNamespace(tokens=torch.tensor([7, 8]))
    with pytest.raises(RuntimeError, match="a: its input tokens are not known yet"):
        flatten([ScheduledRequest(req, 4, 1, [0, 1], samples=True)], prev, BS, CPU, mrope=False)
    one = Request("b", None, [1, 2], SamplingParams(max_tokens=8))
    one.output_token_ids = [5]
    one.add_pending(1)
    seqs = [ScheduledRequest(one, 3, 1, [0], samples=True)]
    with pytest.raises(RuntimeError, match="b: its input tokens are not known yet"):
        flatten(seqs, None, BS, CPU, mrope=False)  # no previous step to take it from
    assert flatten(seqs, prev, BS, CPU, mrope=False).fill[1].tolist() == [8]
