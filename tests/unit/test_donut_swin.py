"""DonutSwinTower against transformers' DonutSwinModel on tiny random configs (norms and position biases random)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DonutSwinConfig, DonutSwinModel

from mmserve.models.donut_swin import DonutSwinTower

TOL = dict(
    rtol=1e-5, atol=4e-5
)  # fp32: outputs reach ~25 after three stages, so rounding reaches ~1.6e-5
TOL_FP64 = dict(
    rtol=1e-10, atol=1e-10
)  # fp64: the same arithmetic, so this shows the math is HF's exactly
IMAGE = (
    56,
    42,
)  # 42 is no multiple of the patch (4): the image is padded to 44 -> a 14 x 11 patch grid


def tiny_config(window: int, depths: list[int], heads: list[int]) -> DonutSwinConfig:
    return DonutSwinConfig(
        image_size=list(IMAGE),
        patch_size=4,
        embed_dim=16,
        depths=depths,
        num_heads=heads,
        window_size=window,
        layer_norm_eps=1e-6,
        drop_path_rate=0.1,
    )


# window 4: grids 14x11 (padded to 16x12) -> merge of an odd width -> 7x6 (padded to 8x8); both stages shift by 2
SHIFTED = dict(window=4, depths=[2, 2], heads=[2, 4])
# window 3: 14x11 (padded 15x12) -> 7x6 (padded 9x6) -> 4x3, whose short side equals the window: no shift there
LAST_STAGE_AT_WINDOW = dict(window=3, depths=[2, 2, 2], heads=[2, 4, 8])
# window 4 with a third stage: its 4x3 map is smaller than the window
LAST_STAGE_BELOW_WINDOW = dict(window=4, depths=[2, 2, 2], heads=[2, 4, 8])


def random_hf(config: DonutSwinConfig, seed: int = 0) -> DonutSwinModel:
    torch.manual_seed(seed)
    model = DonutSwinModel(config).eval()
    with (
        torch.no_grad()
    ):  # norms init to 1 / 0 and bias tables to 0: randomize everything so every path matters
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "relative_position_bias_table" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model


def ours_from(hf: DonutSwinModel) -> DonutSwinTower:
    tower = DonutSwinTower(hf.config)
    tower.load_weights(hf.state_dict().items())  # relative_position_index buffers included: skipped
    return tower.eval()


def images(n: int, size: tuple[int, int] = IMAGE, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, *size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(
    scope="module", params=[SHIFTED, LAST_STAGE_AT_WINDOW], ids=["shifted", "last_stage_at_window"]
)
def pair(request):
    hf = random_hf(tiny_config(**request.param))
    return hf, ours_from(hf)


def test_parameter_names_equal_transformers(pair):
    hf, ours = pair
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in hf.named_parameters()}
    assert not any(p.requires_grad for p in ours.parameters())


@pytest.mark.parametrize("size", [IMAGE, (53, 45)], ids=["config_size", "other_size"])
def test_matches_transformers_last_hidden_state(pair, size):
    hf, ours = pair
    pixels = images(2, size)
    with torch.no_grad():
        got = ours(pixels)
        want = hf(pixel_values=pixels).last_hidden_state
    stages = len(hf.config.depths)
    h, w = -(-size[0] // 4), -(-size[1] // 4)
    for _ in range(stages - 1):
        h, w = (h + 1) // 2, (w + 1) // 2
    assert got.shape == (2, h * w, 16 * 2 ** (stages - 1)) == want.shape
    torch.testing.assert_close(got, want, **TOL)


def test_matches_transformers_exactly_in_fp64(pair):
    hf, ours = pair
    pixels = images(2).double()
    with torch.no_grad():
        got = ours_from(hf).double()(pixels)
        want = copy.deepcopy(hf).double()(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(got, want, **TOL_FP64)


def test_last_stage_at_window_size_does_not_shift():
    """With the map's short side == window, HF turns the shift off; shifting anyway would change the output."""
    hf = random_hf(tiny_config(**LAST_STAGE_AT_WINDOW))
    ours = ours_from(hf)
    pixels = images(2)
    with torch.no_grad():
        want = hf(pixel_values=pixels).last_hidden_state
        assert [b.shift_size for b in hf.encoder.layers[2].blocks] == [0, 0]
        torch.testing.assert_close(ours(pixels), want, **TOL)


def test_map_smaller_than_window_is_refused_like_transformers():
    hf = random_hf(tiny_config(**LAST_STAGE_BELOW_WINDOW))
    ours = ours_from(hf)
    pixels = images(1)
    with torch.no_grad():
        with pytest.raises(RuntimeError):  # HF's bias table keeps the 4x4 window: a shape mismatch
            hf(pixel_values=pixels)
        with pytest.raises(ValueError, match="smaller than the 4x4 window"):
            ours(pixels)


def test_batched_images_are_independent(pair):
    _, ours = pair
    pixels = images(3)
    with torch.no_grad():
        together = ours(pixels)
        alone = torch.cat([ours(pixels[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(together, alone, **TOL)


def test_bf16_runs_close_to_fp32(pair):
    hf, ours = pair
    pixels = images(2)
    with torch.no_grad():
        want = ours(pixels)
        got = ours_from(hf).to(torch.bfloat16)(pixels)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    rel = (got.float() - want).norm() / want.norm()
    assert rel < 0.05, rel
