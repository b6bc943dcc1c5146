"""Split-K partition counts of the decode kernel (host-side choice, kernels/paged_decode.py)."""

from __future__ import annotations

import pytest
import torch

from mmserve.kernels import paged_decode


@pytest.fixture
def h100_sms(monkeypatch):
    monkeypatch.setattr(paged_decode, "_num_sms", lambda device: 132)


@pytest.mark.parametrize(
    "num_seqs, kv_heads, max_context, want",
    [
        (
            1,
            32,
            4096,
            16,
        ),  # 32 programs fill under a quarter of 132 SMs: 4x fill (17), capped at 4096 / 256
        (1, 32, 1024, 4),  # no partition shorter than 256 tokens of the widest context
        (2, 32, 4096, 5),  # 64 programs: 2x fill
        (4, 32, 4096, 3),
        (1, 8, 16384, 32),  # GQA, 8 programs: 4x fill wants 66, capped at _MAX_SPLITS
        (256, 32, 4096, 1),  # a full batch needs no split
    ],
)
def test_split_count(h100_sms, num_seqs, kv_heads, max_context, want):
    got = paged_decode.default_num_splits(num_seqs, kv_heads, max_context, torch.device("cuda"))
    assert got == want
