"""layers/group_int4.py: RTN group quantization's error bound and the AWQ / GPTQ packings, checked against a
bit-by-bit construction of the published layouts written here independently (Python ints, one nibble at a time)."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.group_int4 import (
    dequantize_groups,
    pack_awq,
    pack_gptq,
    pack_nibbles_k,
    quantize_groups,
    unpack_awq,
    unpack_gptq,
    unpack_nibbles_k,
)


def _word(nibbles: list[int]) -> int:
    """A signed int32 whose bits 4i..4i+3 hold nibbles[i]."""
    v = 0
    for i, x in enumerate(nibbles):
        v |= (int(x) & 0xF) << (4 * i)
    return v - (1 << 32) if v >= 1 << 31 else v


def _awq_words(m: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's packing of m [R, C]: word c of row r holds columns 8c+0, 8c+2, 8c+4, 8c+6, 8c+1, 8c+3, ..."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, cols = m.shape
    out = [[_word([m[r, 8 * c + o] for o in order]) for c in range(cols // 8)] for r in range(rows)]
    return torch.tensor(out, dtype=torch.int32)


def _seq_words(m: torch.Tensor) -> torch.Tensor:
    """Sequential packing of m [R, C]: word c of row r holds columns 8c .. 8c + 7 in nibbles 0..7."""
    rows, cols = m.shape
    out = [
        [_word([m[r, 8 * c + j] for j in range(8)]) for c in range(cols // 8)] for r in range(rows)
    ]
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("zero_point", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_dequantize_error_within_half_a_step(zero_point: bool, group_size: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 256) * torch.linspace(0.01, 3.0, 24)[:, None]
    w[3, :40] += 5.0  # a group with an outlier, one with only positive values
    q, scales, zeros = quantize_groups(w, group_size, zero_point)
    g = 256 // (256 if group_size == -1 else group_size)
    assert q.dtype == zeros.dtype == torch.uint8 and scales.dtype == torch.float32
    assert q.shape == (24, 256) and scales.shape == zeros.shape == (24, g)
    assert int(q.max()) <= 15
    if not zero_point:
        assert bool((zeros == 8).all())
    deq = dequantize_groups(q, scales, zeros, group_size)
    step = scales.repeat_interleave(256 // g, dim=1)
    assert bool(((deq - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all())
    # and the step is as small as the group's range allows (not a loose bound satisfied trivially)
    rng = w.reshape(24, g, -1)
    span = rng.amax(2).clamp(min=0) - rng.amin(2).clamp(max=0)
    if zero_point:
        torch.testing.assert_close(scales, span / 15)


def test_g_idx_selects_each_columns_group() -> None:
    torch.manual_seed(1)
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    scales, zeros = torch.rand(8, 4) + 0.1, torch.randint(1, 16, (8, 4), dtype=torch.uint8)
    g_idx = torch.randperm(64) % 4
    deq = dequantize_groups(q, scales, zeros, 16, g_idx=g_idx)
    for n, k in [(0, 0), (3, 17), (7, 63), (5, 40)]:
        g = int(g_idx[k])
        assert deq[n, k] == (int(q[n, k]) - int(zeros[n, g])) * scales[n, g]


def test_awq_layout_bit_for_bit() -> None:
    torch.manual_seed(2)
    n, k, gs = 16, 64, 32
    q, scales, zeros = quantize_groups(torch.randn(n, k), gs)
    packed = pack_awq(q, zeros, scales)
    assert packed["qweight"].dtype == packed["qzeros"].dtype == torch.int32
    assert packed["qweight"].shape == (k, n // 8) and packed["qzeros"].shape == (k // gs, n // 8)
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (k // gs, n)
    assert torch.equal(packed["qweight"], _awq_words(q.t()))
    assert torch.equal(packed["qzeros"], _awq_words(zeros.t()))
    q2, z2, s2 = unpack_awq(packed["qweight"], packed["qzeros"], packed["scales"])
    assert torch.equal(q2, q) and torch.equal(z2, zeros)
    torch.testing.assert_close(s2, scales.half().float(), rtol=0, atol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layout_bit_for_bit(act_order: bool) -> None:
    torch.manual_seed(3)
    n, k, gs = 16, 64, 16
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    zeros = torch.randint(1, 17, (n, k // gs), dtype=torch.uint8)  # 16 is storable as 15 + 1
    scales = torch.rand(n, k // gs) + 0.01
    g_idx = (torch.randperm(k) % (k // gs)).int() if act_order else None
    packed = pack_gptq(q, zeros, scales, g_idx)
    assert packed["qweight"].shape == (k // 8, n) and packed["qzeros"].shape == (k // gs, n // 8)
    assert torch.equal(packed["qweight"], _seq_words(q).t())  # packed along K
    assert torch.equal(packed["qzeros"], _seq_words((zeros.to(torch.int64) - 1).t()))  # zero - 1
    expected_g = g_idx if act_order else torch.arange(k) // gs
    assert packed["g_idx"].dtype == torch.int32 and torch.equal(
        packed["g_idx"].long(), expected_g.long()
    )
    q2, z2, s2, g2 = unpack_gptq(**packed)
    assert torch.equal(q2, q) and torch.equal(z2, zeros) and torch.equal(g2, expected_g.long())
    torch.testing.assert_close(s2, scales.half().float(), rtol=0, atol=0)


def test_gptq_symmetric_zero_is_the_published_constant() -> None:
    """Symmetric GPTQ checkpoints store zero 8 as 7: every qzeros word is 0x77777777."""
    q, scales, zeros = quantize_groups(torch.randn(8, 256), 128, zero_point=False)
    assert bool((pack_gptq(q, zeros, scales)["qzeros"] == 0x77777777).all())


def test_gptq_refuses_a_zero_it_cannot_store() -> None:
    zeros = torch.zeros(8, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="zero point of 0"):
        pack_gptq(torch.zeros(8, 8, dtype=torch.uint8), zeros, torch.ones(8, 1))


@pytest.mark.parametrize("k", [48, 40])
def test_layers_layout_pairs_each_column_with_the_one_8_later(k: int) -> None:
    """Byte j of block b holds column 16b + j (low nibble) and 16b + 8 + j (high); a last half block (K = 40) is
    padded with zero nibbles, and unpacking to K columns gives q back."""
    torch.manual_seed(3)
    q = torch.randint(0, 16, (3, k), dtype=torch.uint8)
    packed = pack_nibbles_k(q)
    assert packed.shape == (3, -(-k // 16) * 8)
    for r, col in [(0, 0), (1, 7), (2, 16), (0, 21), (1, 32), (2, 39)]:
        block, j = divmod(col, 16)
        byte = int(packed[r, 8 * block + j % 8])
        assert (byte >> 4 if j >= 8 else byte & 0xF) == int(q[r, col])
    if k % 16:
        assert int((packed[:, -4:] >> 4).max()) == 0  # the missing columns 40..47
    assert torch.equal(unpack_nibbles_k(packed, k), q)
