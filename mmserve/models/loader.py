"""Build our model for a HF checkpoint directory, on the target device and dtype, and load its weights."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from mmserve.models.registry import get_model_class
from mmserve.models.weights import iter_safetensors


def load_hf_config(model_dir: str):
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ValueError(f"{model_dir!r} is not a Hugging Face checkpoint directory (no config.json)")
    return AutoConfig.from_pretrained(model_dir)


def text_config_of(hf_config):
    return getattr(hf_config, "text_config", None) or hf_config


def build_model(model_dir: str, hf_config, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Instantiate directly on `device` in `dtype` (no fp32 host copy), then stream the weights in."""
    cls = get_model_class(hf_config)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(old)
    model.load_weights(iter_safetensors(model_dir))
    return model.eval()
