"""The torch backend's padded attention with a dense score bias (T5-style decoders: Flan-T5, Pix2Struct) equals its
sequence-by-sequence `paged_attention(bias_fn=...)` on mixed steps: decodes, prompt chunks over a cached prefix,
grouped heads, an FP8 cache; and a step whose bias would be too large is left to the per-sequence path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmserve.attention import torch_backend
from mmserve.models.t5 import T5Attention
from tests.kernels.attention_checks import make_batch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _t5_bias(heads: int, device: str) -> T5Attention:
    config = SimpleNamespace(
        num_heads=heads,
        d_kv=8,
        d_model=heads * 8,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
    )
    attn = T5Attention(config, has_bias=True)
    torch.nn.init.normal_(
        attn.relative_attention_bias.weight, std=2.0, generator=torch.Generator().manual_seed(3)
    )
    return attn.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("kv_heads", "cache_dtype"), [(4, None), (2, None), (4, torch.float8_e4m3fn)]
)
def test_padded_attention_equals_the_per_sequence_path(device, kv_heads, cache_dtype):
    q_lens, ctx_lens = (
        [1, 1, 5, 3, 1],
        [7, 30, 9, 3, 1],
    )  # decodes, a chunk after a prefix, a whole prompt
    q, k, v, cache, meta = make_batch(
        q_lens,
        ctx_lens,
        4,
        kv_heads,
        8,
        4,
        torch.float32,
        torch.device(device),
        cache_dtype=cache_dtype,
    )
    scales = (0.5, 2.0) if cache_dtype is not None else (1.0, 1.0)
    torch_backend.write_kv(k, v, cache, meta.slot_mapping, *scales)
    attn = _t5_bias(4, device)
    with torch.no_grad():
        padded = torch_backend.padded_batch(meta, attn.position_bias, 4)
        assert padded is not None and padded.max_q == 5
        got = torch_backend.padded_attention(q, cache, padded, 1.0, *scales)
        want = torch_backend.paged_attention(
            q, cache, meta, 1.0, *scales, bias_fn=attn.position_bias
        )
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
