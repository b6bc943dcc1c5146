"""Padded attention of several sequences in one call equals one call per sequence: the torch backend's attention
with a dense score bias (T5-style decoders: Flan-T5, Pix2Struct) against its sequence-by-sequence
`paged_attention(bias_fn=...)` on mixed steps (decodes, prompt chunks over a cached prefix, grouped heads, an FP8
cache; a step whose bias would be too large left to the per-sequence path), and the cross-attention's padded groups
(`layers/cross_attention.py`) against separate SDPA calls."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmserve.attention import torch_backend
from mmserve.models.t5 import T5Attention
from tests.kernels.attention_checks import make_batch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _t5_bias(heads: int, device: str) -> T5Attention:
    config = SimpleNamespace(num_heads=heads, d_kv=8, d_model=heads * 8, relative_attention_num_buckets=8,
                             relative_attention_max_distance=16)
    attn = T5Attention(config, has_bias=True)
    torch.nn.init.normal_(attn.relative_attention_bias.weight, std=2.0, generator=torch.Generator().manual_seed(3))
    return attn.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kv_heads", "cache_dtype"), [(4, None), (2, None), (4, torch.float8_e4m3fn)])
def test_padded_attention_equals_the_per_sequence_path(device, kv_heads, cache_dtype):
    q_lens, ctx_lens = [1, 1, 5, 3, 1], [7, 30, 9, 3, 1]   # decodes, a chunk after a prefix, a whole prompt
    q, k, v, cache, meta = make_batch(q_lens, ctx_lens, 4, kv_heads, 8, 4, torch.float32, torch.device(device),
                                      cache_dtype=cache_dtype)
    scales = (0.5, 2.0) if cache_dtype is not None else (1.0, 1.0)
    torch_backend.write_kv(k, v, cache, meta.slot_mapping, *scales)
    attn = _t5_bias(4, device)
    with torch.no_grad():
        padded = torch_backend.padded_batch(meta, attn.position_bias, 4)
        assert padded is not None and padded.max_q == 5
        got = torch_backend.padded_attention(q, cache, padded, 1.0, *scales)
        want = torch_backend.paged_attention(q, cache, meta, 1.0, *scales, bias_fn=attn.position_bias)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.isnan(got).any()


def test_a_bias_too_large_goes_sequence_by_sequence(monkeypatch):
    _, _, _, _, meta = make_batch([4, 1], [4, 9], 4, 4, 8, 4, torch.float32, torch.device("cpu"))
    attn = _t5_bias(4, "cpu")
    # 2 sequences x 4 heads x 4 queries x 12 keys (three whole blocks) = 384 elements
    monkeypatch.setattr(torch_backend, "PADDED_BIAS_MAX_ELEMENTS", 383)
    assert torch_backend.padded_batch(meta, attn.position_bias, 4) is None
    monkeypatch.setattr(torch_backend, "PADDED_BIAS_MAX_ELEMENTS", 384)
    assert torch_backend.padded_batch(meta, attn.position_bias, 4) is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cap_seqs", [1, 2, 100])
def test_cross_attention_padded_groups_equal_one_call_per_sequence(device, cap_seqs, monkeypatch):
    """Sequences of different row and key counts, grouped heads, a per-row mask on one (Mllama): every grouping
    (one sequence per call, pairs, all at once) gives what separate SDPA calls give."""
    import torch.nn.functional as F

    from mmserve.layers import cross_attention

    gen = torch.Generator().manual_seed(0)
    rows, keys = [1, 3, 1, 2], [5, 9, 2, 7]
    q = torch.randn(sum(rows), 4, 8, generator=gen).to(device)
    seqs = []
    for n, t in zip(rows, keys):
        k, v = (torch.randn(t, 2, 8, generator=gen).to(device) for _ in range(2))
        mask = (torch.rand(n, t, generator=gen) > 0.4).to(device) if n == 3 else None
        if mask is not None:
            mask[:, 0] = True   # no row without a key
        seqs.append((n, k, v, mask))
    monkeypatch.setattr(cross_attention, "PADDED_KV_MAX_BYTES", cap_seqs * 9 * 2 * 2 * 8 * 4)
    got = cross_attention.attend_per_sequence(q, seqs, 0.3)
    want, row = [], 0
    for n, k, v, mask in seqs:
        o = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=None if mask is None else mask[None, None],
                                           scale=0.3, enable_gqa=True)
        want.append(o[0].transpose(0, 1))
        row += n
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
