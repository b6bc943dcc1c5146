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
from mmserve.worker.batch_inputs import attention_metadata, num_leading_decodes, padded_tables
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


def test_positions_of_a_request_with_its_own_follow_range_positions_of_the_ones_before():
    plain = _request("a", [1, 2, 3], outputs=[4])  # a decode at position 3
    own = _request("b", [5, 6, 7, 8])  # M-RoPE: its prompt positions, [3, P]
    own.prompt_positions = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 2], [0, 1, 1, 1]])
    chunk = _request("c", [9, 9, 9, 9, 9])  # a prompt chunk [1, 4) after it
    seqs = [
        ScheduledRequest(plain, 3, 1, [0], samples=True),
        ScheduledRequest(own, 0, 4, [1], samples=True),
        ScheduledRequest(chunk, 1, 3, [2, 3]),
    ]
    batch = flatten(seqs, None, BS, torch.device("cpu"), mrope=True)
    assert batch.positions.tolist() == [
        [3, 0, 1, 1, 2, 1, 2, 3],
        [3, 0, 1, 2, 2, 1, 2, 3],
        [3, 0, 1, 1, 1, 1, 2, 3],
    ]
    assert batch.prompt_chunks == [1, 2]  # the decode has no prompt token
    assert batch.slots == [3, 4, 5, 6, 7, 9, 10, 11]


def test_range_positions_match_each_sequences_own_range():
    reqs = [_request("a", [1] * 9, outputs=[2, 3]), _request("b", [1] * 20)]
    seqs = [ScheduledRequest(reqs[0], 10, 1, [0, 1, 2]), ScheduledRequest(reqs[1], 4, 7, [3, 4, 5])]
    for mrope in (False, True):
        batch = flatten(seqs, None, BS, torch.device("cpu"), mrope=mrope)
        want = [10, 4, 5, 6, 7, 8, 9, 10]
        assert batch.positions.tolist() == ([want] * 3 if mrope else want)
        assert batch.input_ids == [3, *[1] * 7] and batch.prompt_chunks == [1]


def test_padded_block_tables_and_leading_decodes():
    tables = padded_tables([[4, 5], [7], [1, 2, 3]])
    assert tables.dtype == torch.int32 and tables.tolist() == [[4, 5, 0], [7, 0, 0], [1, 2, 3]]
    assert num_leading_decodes([0, 1, 2, 5, 6]) == 2
    assert num_leading_decodes([0, 1, 2, 3]) == 3
    assert num_leading_decodes([0, 4, 5]) == 0
    meta = attention_metadata([[4, 5], [7]], [1, 2, 3], [0, 1, 3], [5, 2], BS, torch.device("cpu"))
    assert meta.block_tables.tolist() == [[4, 5], [7, 0]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_decodes) == (2, 5, 1)


def test_padded_tables_come_from_the_schedulers_rows_as_padding_them_would_give():
    from mmserve.config import SchedulerConfig
    from mmserve.engine.kv_cache import KVCacheManager
    from mmserve.engine.scheduler import Scheduler

    kv = KVCacheManager(num_blocks=64, block_size=BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv)
    for rid, n in (("a", 9), ("b", 2), ("c", 17)):
        sched.add(_request(rid, list(range(1, n + 1))))
    out = sched.schedule()
    batch = flatten(out.scheduled, None, BS, torch.device("cpu"), False, out.block_table)
    want = padded_tables([s.block_ids for s in out.scheduled]).numpy()
    assert batch.padded_tables.tolist() == want.tolist() and want.shape == (3, 5)
    # sequences without rows (built by hand) leave the padding to attention_metadata
    assert flatten(out.scheduled[:1], None, BS, torch.device("cpu"), False).padded_tables is None
