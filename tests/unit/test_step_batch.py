"""worker/step_batch.flatten: a step's chunks as flat token lists (ids, positions, slots, offsets), the rows whose
input token the previous step sampled on the device, and which sequences sample."""

from __future__ import annotations

import types

import pytest
import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.core.step import ScheduledRequest
from mmserve.engine.request import Request
from mmserve.sampling_params import SamplingParams
from mmserve.worker.step_batch import flatten

BS = 4


def _request(
    rid: str, prompt: list[int], outputs: list[int] = (), pending: bool = False, row: int = -1
) -> Request:
    req = Request(rid, None, prompt, SamplingParams(max_tokens=8))
    req.output_token_ids = list(outputs)
    if pending:  # the last output is a placeholder the previous step sampled into `row`
        req.add_pending(row)
    return req


def test_chunks_lay_out_ids_positions_slots_and_offsets():
    a = _request("a", [10, 11, 12, 13, 14, 15])  # prompt chunk [2, 6), blocks 7, 3
    b = _request("b", [20, 21, 22], outputs=[23])  # a decode of its 4th token, block 5
    seqs = [
        ScheduledRequest(b, 3, 1, [5], samples=True),
        ScheduledRequest(a, 2, 4, [7, 3], samples=True),
    ]
    batch = flatten(seqs, None, BS, torch.device("cpu"), mrope=False)
    assert batch.input_ids == [23, 12, 13, 14, 15]
    assert batch.positions.tolist() == [3, 2, 3, 4, 5]
    assert batch.slots == [5 * BS + 3, 7 * BS + 2, 7 * BS + 3, 3 * BS + 0, 3 * BS + 1]
    assert (batch.qsl, batch.seq_lens, batch.sampling) == ([0, 1, 5], [4, 6], [0, 1])
    assert batch.block_tables == [[5], [7, 3]] and batch.fill is None
    assert not batch.one_token_each


def test_placeholder_inputs_come_from_the_previous_steps_samples_on_the_device():
    a = _request("a", [1, 2], outputs=[3], pending=True, row=2)
    b = _request("b", [4, 5], outputs=[6])
    prev = types.SimpleNamespace(tokens=torch.tensor([70, 71, 72, 73]))
    seqs = [
        ScheduledRequest(b, 2, 1, [0], samples=True),
        ScheduledRequest(a, 3, 1, [1], samples=False),
    ]
    batch = flatten(seqs, prev, BS, torch.device("cpu"), mrope=False)
    assert batch.input_ids == [6, -1]  # PLACEHOLDER on the host
    rows, ids = batch.fill
    assert rows.tolist() == [1] and ids.tolist() == [
        72
    ]  # a's input token is prev's row 2, at flat row 1
    assert batch.sampling == [0] and batch.one_token_each
    with pytest.raises(RuntimeError, match="a: its input tokens are not known yet"):
        flatten(seqs, None, BS, torch.device("cpu"), mrope=False)


def test_a_one_token_chunk_of_a_picture_is_not_a_decode():
    item = MultiModalItem("image", {}, offset=1, length=3, content_hash="x")
    req = Request("a", None, [9, 0, 0, 0, 8], SamplingParams(max_tokens=4), mm_items=[item])
    batch = flatten([ScheduledRequest(req, 2, 1, [0])], None, BS, torch.device("cpu"), mrope=False)
    assert len(batch.input_ids) == 1 and not batch.one_token_each
