"""core/transfer.host_tensor (the fast list -> tensor conversion gives exactly what torch.tensor gives) and the
slot ids of a step's tokens (batch_inputs.slot_ids), the host-side inputs of every step."""

from __future__ import annotations

import pytest
import torch

from mmserve.core.transfer import copy_into, host_tensor, to_device


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.float32, torch.float64, torch.bool]
)
def test_host_tensor_matches_torch_tensor(dtype: torch.dtype) -> None:
    floats = [0.1, -2.5, 1e-7] if dtype.is_floating_point else [0, 1, 1]
    cases = [[3, -1, 7, 2**20], (5, 6), range(4, 9), [[1, 2, 3], [4, 5, 6]], floats]
    for values in cases:
        if dtype == torch.bool and not isinstance(values, list):
            continue
        want = torch.tensor(list(values) if isinstance(values, range) else values, dtype=dtype)
        got = host_tensor(values, dtype)
        assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want), (
            values,
            dtype,
        )
    assert host_tensor([], torch.int64).shape == (0,) and host_tensor(
        [[], []], torch.int64
    ).shape == (2, 0)


def test_host_tensor_rejects_ragged_rows_and_overflow_like_torch() -> None:
    with pytest.raises(ValueError):
        host_tensor([[1, 2], [3]], torch.int64)
    with pytest.raises((OverflowError, RuntimeError)):
        host_tensor([2**40], torch.int32)


def test_to_device_and_copy_into_on_cpu() -> None:
    t = to_device([[1, 2], [3, 4]], torch.int32, torch.device("cpu"))
    assert t.tolist() == [[1, 2], [3, 4]] and t.dtype == torch.int32
    dst = torch.zeros(2, 2, dtype=torch.int64)
    copy_into(dst, [5, 6, 7, 8])
    assert dst.tolist() == [[5, 6], [7, 8]]


def test_slot_ids_match_the_per_token_formula() -> None:
    from mmserve.worker.batch_inputs import slot_ids

    blocks = [7, 2, 9, 4, 11]
    for bs in (1, 4, 16):
        table = blocks * (64 // bs)  # enough blocks for 64 positions
        for start, end in [
            (0, 1),
            (0, 16),
            (3, 4),
            (5, 37),
            (15, 17),
            (16, 32),
            (31, 64),
            (63, 64),
        ]:
            want = [table[p // bs] * bs + p % bs for p in range(start, end)]
            assert slot_ids(table, start, end, bs) == want, (bs, start, end)
