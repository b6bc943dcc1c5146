"""The Qwen2-VL / Qwen2.5-VL vision tower on CUDA: one varlen flash call per block gives what one SDPA call per
run of equal segments gives, for a batch of pictures of different sizes and a video, at the real head size, and
a tower call makes the host wait for nothing."""

from __future__ import annotations

import pytest
import torch

from mmserve.attention.packed import varlen_attn
from mmserve.models.qwen2_vl_vision import Qwen2VisionTransformer
from mmserve.testing.qwen2_vl import qwen2_vl_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(varlen_attn is None, reason="this torch has no varlen flash attention"),
]

# head_dim 80 and the real window (112 px: 4x4 merged tokens); a few blocks, narrow MLPs
SHAPES = {
    "qwen2": dict(preset="tiny", vision_embed=160, vision_heads=2, vision_depth=3),
    "qwen2.5": dict(
        preset="tiny-2.5",
        vision_embed=160,
        vision_heads=2,
        vision_depth=4,
        vision_intermediate=96,
        window_size=112,
        fullatt_blocks=(1, 3),
    ),
}
# pictures with partial edge windows, a 2-frame video, two equal pictures next to each other, one large
GRIDS = [[1, 36, 52], [2, 8, 8], [1, 14, 22], [1, 14, 22], [1, 102, 102]]


def _tower(shape: str) -> Qwen2VisionTransformer:
    kwargs = dict(SHAPES[shape])
    vision = qwen2_vl_config(kwargs.pop("preset"), **kwargs).vision_config
    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = Qwen2VisionTransformer(vision)
    for name, p in tower.named_parameters():
        norm = p.dim() == 1 and ("norm" in name or "ln_q" in name) and name.endswith("weight")
        p.normal_(1.0 if norm else 0.0, 0.05)
    return tower.to(torch.bfloat16)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_varlen_tower_matches_sdpa_runs(shape):
    tower = _tower(shape)
    n = sum(t * h * w for t, h, w in GRIDS)
    pixels = torch.randn(n, 3 * 2 * 14 * 14, device="cuda")
    plan = tower.plan(GRIDS, pixels.device, torch.bfloat16)
    assert plan.frames.cu_seqlens is not None and plan.windows.cu_seqlens is not None
    assert plan.frames.cu_seqlens.tolist()[-1] == n
    with torch.inference_mode():
        got = tower(pixels, GRIDS)
        tower.varlen = False
        want = tower(pixels, GRIDS)
    assert tower.plan(GRIDS, pixels.device, torch.bfloat16).windows.cu_seqlens is None
    assert got.shape == want.shape == (n // 4, tower.merger.mlp[2].out_features)
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, f"relative error {err:.2e}"
    # segments attend only themselves: the last picture alone gives its rows of the batch
    with torch.inference_mode():
        tower.varlen = True
        alone = tower(pixels[-102 * 102 :], GRIDS[-1:])
    err = (alone.float() - got[-len(alone) :].float()).norm() / alone.float().norm()
    assert err < 1e-2, f"relative error alone vs in the batch {err:.2e}"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tower_call_never_waits_for_the_gpu(shape):
    tower = _tower(shape)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 14 * 14, device="cuda")
    with torch.inference_mode():
        tower(pixels, GRIDS)  # compiles the kernels; the plan is built again below
        tower._plans.clear()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tower(pixels, GRIDS)  # a fresh plan: pinned uploads only
            tower(pixels, GRIDS)  # the kept plan
        finally:
            torch.cuda.set_sync_debug_mode("default")
