"""The pictures handed to a torchvision image processor as uint8 [3, H, W] tensors (processors.chw_uint8) give
exactly the pixel values the processor makes of the PIL pictures themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CLIPImageProcessor

from mmserve.multimodal.processors import TorchvisionBackend, chw_uint8
from mmserve.testing import make_test_image

# LLaVA-1.5's (openai/clip-vit-large-patch14-336) settings, and the tiny demo checkpoint's
LLAVA_15 = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}
TINY = {"size": {"shortest_edge": 42}, "crop_size": {"height": 42, "width": 42}}
CLIP_NORM = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "resample": 3,
}


def noisy_picture(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = np.asarray(make_test_image(seed, size), dtype=np.int16)
    return Image.fromarray(
        np.clip(pixels + rng.integers(-9, 10, pixels.shape), 0, 255).astype(np.uint8)
    )


def test_the_split_bands_are_the_pictures_pixels_channel_first():
    picture = noisy_picture(0, (37, 23))
    got = chw_uint8(picture)
    assert got.dtype == torch.uint8 and got.shape == (3, 23, 37)
    assert torch.equal(got, torch.from_numpy(np.asarray(picture).copy()).permute(2, 0, 1))
    grey = picture.convert("L")
    assert chw_uint8(grey) is grey  # only RGB pictures are converted


@pytest.mark.parametrize("settings", [LLAVA_15, TINY], ids=["llava-1.5-336", "tiny"])
@pytest.mark.parametrize("size", [(336, 336), (640, 480), (333, 517), (50, 41)])
def test_processor_outputs_equal_those_of_the_pil_pictures(settings, size):
    processor = CLIPImageProcessor(**settings, **CLIP_NORM)
    assert TorchvisionBackend is not None and isinstance(processor, TorchvisionBackend)
    pictures = [noisy_picture(i, size) for i in range(2)]
    want = processor(pictures, return_tensors="pt")["pixel_values"]
    got = processor([chw_uint8(p) for p in pictures], return_tensors="pt")["pixel_values"]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)
