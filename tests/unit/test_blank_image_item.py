"""InputProcessor.blank_image_item: the encoder inputs of one blank picture, as the checkpoint's processor
prepares a real image (the engine warms the vision encoder's CUDA graphs with it)."""

from __future__ import annotations

import pytest

from mmserve.models.loader import load_hf_config
from mmserve.models.registry import get_model_class
from mmserve.multimodal.processors import InputProcessor
from mmserve.testing import make_checkpoint, make_test_image

# family -> a prompt with one image, as a user writes it
PROMPTS = {
    "llava": "USER: <image>\nwhat is it? ASSISTANT:",
    "blip2": "Question: what is it? Answer:",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>what is it?",
}


@pytest.mark.parametrize("family", sorted(PROMPTS))
def test_blank_item_has_the_shapes_of_a_real_image(family, tmp_path):
    model_dir = str(make_checkpoint(family, tmp_path))
    hf_config = load_hf_config(model_dir)
    inputs = InputProcessor(model_dir, hf_config, get_model_class(hf_config))
    size = (56, 56)
    real = inputs.process(
        {"prompt": PROMPTS[family], "images": [make_test_image(3, size)]}
    ).mm_items[0]
    blank = inputs.blank_image_item(size)
    assert blank is not None and blank.modality == "image"
    assert blank.length == real.length
    assert {k: (tuple(v.shape), v.dtype) for k, v in blank.data.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in real.data.items()
    }
    assert blank.content_hash != real.content_hash
