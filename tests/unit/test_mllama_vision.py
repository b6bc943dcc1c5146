"""MllamaVisionTower against transformers' MllamaVisionModel on a tiny random config (every gate and embedding nonzero)."""

from __future__ import annotations

import pytest
import torch
from transformers import MllamaVisionConfig, MllamaVisionModel

from mmserve.models.mllama_vision import MllamaVisionTower

HIDDEN, TILES = 32, 4
ASPECT_RATIOS = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]  # id = index + 1
ID_1x2, ID_2x2, ID_1x1 = 2, 6, 1
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny_config(image_size: int, indices: list[int]) -> MllamaVisionConfig:
    return MllamaVisionConfig(
        hidden_size=HIDDEN,
        attention_heads=2,
        intermediate_size=64,
        num_hidden_layers=3,
        num_global_layers=2,
        image_size=image_size,
        patch_size=14,
        max_num_tiles=TILES,
        supported_aspect_ratios=ASPECT_RATIOS,
        intermediate_layers_indices=indices,
        vision_output_dim=HIDDEN * (1 + len(indices)),
        hidden_act="gelu",
    )


def random_hf(config: MllamaVisionConfig, seed: int = 0) -> MllamaVisionModel:
    torch.manual_seed(seed)
    model = MllamaVisionModel(config).eval()
    with (
        torch.no_grad()
    ):  # gates init to 0 / pi/4 and norms to 1 / 0: randomize everything so every path matters
        for name, p in model.named_parameters():
            if "layernorm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "gate" in name:
                p.copy_(torch.randn_like(p).clamp(-1.5, 1.5))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def ours_from(
    hf: MllamaVisionModel, config: MllamaVisionConfig | None = None, **kwargs
) -> MllamaVisionTower:
    tower = MllamaVisionTower(config or hf.config, **kwargs)
    tower.load_weights(hf.state_dict().items())
    return tower.eval()


def inputs(ids: list[int], masks: list[list[int]], image_size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(len(ids), TILES, 3, image_size, image_size, generator=g)
    return pixels, torch.tensor(ids), torch.tensor(masks, dtype=torch.long)


@torch.no_grad()
def hf_forward(hf: MllamaVisionModel, pixels, ids, mask) -> torch.Tensor:
    # HF takes [batch, images, tiles, ...]; each of our images is its own batch row
    out = hf(
        pixel_values=pixels[:, None], aspect_ratio_ids=ids[:, None], aspect_ratio_mask=mask[:, None]
    )
    return out.last_hidden_state[:, 0]


@pytest.fixture(
    scope="module", params=[28, 56]
)  # 5 and 17 tokens per tile: both padded up to a multiple of 8
def pair(request):
    config = tiny_config(request.param, [0, 2])
    hf = random_hf(config)
    return hf, ours_from(hf), request.param


@pytest.mark.parametrize(
    "ids, masks",
    [
        ([ID_2x2], [[1, 1, 1, 1]]),  # all tiles valid
        ([ID_1x2], [[1, 1, 0, 0]]),  # two padded tiles: their outputs are compared too
        ([ID_1x2, ID_1x1], [[1, 1, 0, 0], [1, 0, 0, 0]]),  # two different images in one batch
    ],
    ids=["4_of_4_tiles", "2_of_4_tiles", "batch_of_2"],
)
def test_matches_transformers_on_all_tiles(pair, ids, masks):
    hf, ours, image_size = pair
    pixels, ids, mask = inputs(ids, masks, image_size)
    with torch.no_grad():
        got = ours(pixels, ids, mask)
    want = hf_forward(hf, pixels, ids, mask)
    num_patches = (image_size // 14) ** 2 + 1
    assert got.shape == (len(ids), TILES, num_patches, HIDDEN * 3)
    torch.testing.assert_close(got, want, **TOL)


def test_batched_images_are_independent(pair):
    hf, ours, image_size = pair
    pixels, ids, mask = inputs([ID_2x2, ID_1x2], [[1, 1, 1, 1], [1, 1, 0, 0]], image_size)
    with torch.no_grad():
        together = ours(pixels, ids, mask)
        alone = [ours(pixels[i : i + 1], ids[i : i + 1], mask[i : i + 1]) for i in range(2)]
    torch.testing.assert_close(together, torch.cat(alone), **TOL)


def test_output_layout_is_global_then_interleaved_intermediates(pair):
    """Last dim = [global output | intermediates stacked on a last axis, flattened (dim d of k at d*K + k)]."""
    hf, ours, image_size = pair
    pixels, ids, mask = inputs([ID_1x2], [[1, 1, 0, 0]], image_size)
    captured = []
    hook = ours.transformer.layers[2].register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        got = ours(pixels, ids, mask)
    hook.remove()
    layer2_out = captured[0].reshape(1, TILES, -1, HIDDEN)[:, :, : got.shape[2]]
    torch.testing.assert_close(
        got[..., HIDDEN + 1 :: 2], layer2_out, rtol=0, atol=0
    )  # index 2 = output of layer 2


def test_intermediates_as_layer_inputs_shift_by_one_layer():
    """Meta's convention (index i = input of layer i) with indices [1, 3] equals transformers 5.x's with [0, 2]."""
    hf = random_hf(tiny_config(28, [0, 2]))
    shifted = ours_from(hf, tiny_config(28, [1, 3]), intermediates_are_layer_inputs=True)
    pixels, ids, mask = inputs([ID_1x2], [[1, 1, 0, 0]], 28)
    with torch.no_grad():
        torch.testing.assert_close(
            shifted(pixels, ids, mask), ours_from(hf)(pixels, ids, mask), rtol=0, atol=0
        )


def test_bf16_runs_close_to_fp32(pair):
    hf, ours, image_size = pair
    pixels, ids, mask = inputs([ID_1x2, ID_2x2], [[1, 1, 0, 0], [1, 1, 1, 1]], image_size)
    with torch.no_grad():
        want = ours(pixels, ids, mask)
        bf16 = ours_from(hf).to(torch.bfloat16)
        got = bf16(pixels, ids, mask)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.isfinite(got).all()
    rel = (got.float() - want).norm() / want.norm()
    assert rel < 0.05, rel
