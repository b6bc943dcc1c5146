"""The request both FP8 parity files (weights, KV cache) check against transformers: one image prompt, six
greedy tokens with context and generation logits, on the CPU and (gpu-marked) on CUDA."""

from __future__ import annotations

import pytest
import torch

from mmserve import SamplingParams
from mmserve.testing import make_test_image

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FP8 = torch.float8_e4m3fn
PROMPT = {
    "prompt": "USER: <image>\ntell me about it tell me about it number 3 ASSISTANT:",
    "images": [make_test_image(3)],
}
PARAMS = SamplingParams(
    max_tokens=6,
    min_tokens=6,
    temperature=0.0,
    return_context_logits=True,
    return_generation_logits=True,
)
