"""The Qwen2-VL / Qwen2.5-VL vision tower on the CPU: its output against transformers' vision models for a batch
of pictures and a video of different grids (weights through the checkpoint loader), the packed-segment attention
against a block-diagonal mask, and the per-grids plan built once and kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmserve.attention.packed import PackedSegments, packed_attention
from mmserve.models import qwen2_vl_vision
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.qwen2_vl_vision import Qwen2VisionTransformer
from mmserve.models.weights import load_weights
from mmserve.testing.qwen2_vl import qwen2_vl_config

# pictures of different sizes (windows cut partial at the right / bottom edges), a 2-frame video, two equal grids
GRIDS = [[1, 8, 12], [2, 4, 4], [1, 16, 10], [1, 4, 6], [1, 4, 6]]


def _random_tower(preset: str, seed: int) -> tuple[Qwen2VisionTransformer, object]:
    vision = qwen2_vl_config(preset).vision_config
    vision._attn_implementation = "sdpa"
    tower = Qwen2VisionTransformer(vision)
    gen = torch.Generator().manual_seed(seed)
    for p in tower.parameters():  # norms and biases too, so a misplaced one shows
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return tower, vision


def _oracle_weights(tower: Qwen2VisionTransformer) -> dict[str, torch.Tensor]:
    """The tower's weights under transformers' names (gate_up_proj split into gate_proj and up_proj)."""
    out = {}
    for name, t in tower.state_dict().items():
        if ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            out[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            out[name] = t
    return out


def _pixels(grids: list[list[int]], seed: int) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset", ["tiny", "tiny-2.5"])
def test_tower_matches_transformers_vision_model_on_a_mixed_batch(preset):
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    oracle_cls = {
        "tiny": modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel,
        "tiny-2.5": modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel,
    }[preset]
    tower, vision = _random_tower(preset, seed=1)
    oracle = oracle_cls._from_config(vision, dtype=torch.float32).eval()
    weights = _oracle_weights(tower)
    oracle.load_state_dict(weights)
    # and back through the checkpoint loader (packed gate / up parts) into a fresh tower
    tower = Qwen2VisionTransformer(vision)
    load_weights(tower, weights.items(), packed=LlamaForCausalLM.packed_modules)
    pixels = _pixels(GRIDS, seed=2)
    with torch.no_grad():
        want = oracle(pixels, torch.tensor(GRIDS)).pooler_output
        got = tower(pixels, GRIDS)
    assert got.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 80)  # the text width
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_packed_attention_equals_block_diagonal_masked_attention():
    lengths = [5, 5, 3, 7, 7, 7, 1]
    n, heads, head_dim = sum(lengths), 3, 8
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, 3, heads, head_dim, generator=gen)
    q, k, v = qkv.unbind(1)  # strided views, as the tower passes them
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = segment[:, None] == segment[None, :]
    want = F.scaled_dot_product_attention(
        *(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask, scale=0.3
    )
    segments = PackedSegments.build(lengths, torch.device("cpu"), torch.float32)
    assert segments.cu_seqlens is None  # the CPU runs SDPA per run of equal segments
    got = packed_attention(q, k, v, segments, 0.3)
    torch.testing.assert_close(got, want.transpose(0, 1).reshape(n, heads * head_dim))


def test_plan_is_built_once_per_grids_and_the_oldest_is_dropped(monkeypatch):
    tower, _ = _random_tower("tiny-2.5", seed=4)
    cpu = torch.device("cpu")
    first = tower.plan(GRIDS, cpu, torch.float32)
    assert tower.plan([list(g) for g in GRIDS], cpu, torch.float32) is first
    assert tower.plan(GRIDS[:2], cpu, torch.float32) is not first
    # windows: 4x4 patches (2x2 merged tokens); the 8x12 picture has 2 x 3 whole windows
    assert first.windows.lengths[:6] == (16,) * 6
    assert first.frames.lengths == (96, 16, 16, 160, 24, 24)
    monkeypatch.setattr(qwen2_vl_vision, "PLAN_CACHE_SIZE", 2)
    tower.plan([[1, 2, 2]], cpu, torch.float32)
    assert tower.plan(GRIDS, cpu, torch.float32) is not first  # evicted, rebuilt
    assert len(tower._plans) == 2
