"""Build our model for a HF checkpoint directory, on the target device and dtype, and load its weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig

from mmserve.models.quantization import (
    after_loading,
    checkpoint_scheme,
    decoder_linears,
    fuse_activation_quantization,
    prepare_checkpoint_quantization,
    quantize_model,
)
from mmserve.models.registry import class_for_checkpoint, get_model_class

logger = logging.getLogger(__name__)


def load_hf_config(model_dir: str):
    """The checkpoint's config as its family reads it (`MultiModalCausalLM.load_config`: `AutoConfig` unless the
    family's published layout needs its own reader); `AutoConfig` for an architecture no family serves, so the
    error that follows names it."""
    path = Path(model_dir)
    cls = class_for_checkpoint(path)
    if cls is not None:
        return cls.load_config(str(model_dir))
    if not (path / "config.json").exists():
        raise ValueError(
            f"{model_dir!r} is not a Hugging Face checkpoint directory (no config.json)"
        )
    return AutoConfig.from_pretrained(model_dir)


def text_config_of(hf_config):
    """The language model's config: `text_config`, an encoder-decoder's `decoder`, else the config itself."""
    if (
        getattr(hf_config, "is_encoder_decoder", False)
        and getattr(hf_config, "decoder", None) is not None
    ):
        return hf_config.decoder
    return getattr(hf_config, "text_config", None) or hf_config


@dataclass
class LoadedModel:
    """A checkpoint's model built for serving, with the configs and dtype it was built from."""

    hf_config: Any
    text_config: Any  # the language model's (text_config_of)
    dtype: torch.dtype
    model: nn.Module


def load_model(mc, device: torch.device) -> LoadedModel:
    """Build `mc.model` (a ModelConfig) on `device` as the engine serves it: its dtype resolved, the global RNG
    seeded, `mc.quantization` applied. Every tensor-parallel rank calls it, and shards by its rank."""
    from mmserve.config import resolve_dtype

    hf_config = load_hf_config(mc.model)
    text_config = text_config_of(hf_config)
    dtype = resolve_dtype(
        mc.dtype,
        device,
        getattr(text_config, "dtype", None) or getattr(hf_config, "torch_dtype", None),
    )
    torch.manual_seed(mc.seed)
    return LoadedModel(
        hf_config,
        text_config,
        dtype,
        build_model(mc.model, hf_config, device, dtype, mc.quantization),
    )


def build_model(
    model_dir: str,
    hf_config,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
) -> nn.Module:
    """Instantiate directly on `device` in `dtype` (no fp32 host copy), then stream the weights in.

    FP8 checkpoints load their FP8 layers as FP8; `quantization="fp8"` converts the remaining decoder
    linear layers after loading (models/quantization.py).
    """
    cls = get_model_class(hf_config)
    scheme = checkpoint_scheme(getattr(hf_config, "quantization_config", None))
    in_checkpoint = scheme.method if scheme else None
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(old)
    if prepared := prepare_checkpoint_quantization(model, scheme):
        logger.info("checkpoint quantization %s: %d decoder linear layers", in_checkpoint, prepared)
    model.load_weights(cls.checkpoint_weights(model_dir))
    if quantization is not None:
        converted = quantize_model(model, quantization)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the model-dtype weights are gone; let the KV pool have their memory
        logger.info(
            "quantization %s: %d decoder linear layers converted at load", quantization, converted
        )
    after_loading(model)
    linears = decoder_linears(model)
    fp8 = sum(m.is_fp8 for _, m in linears)
    fused = fuse_activation_quantization(model)
    if in_checkpoint == "fp8" or fp8:
        logger.info(
            "FP8 weights in %d of %d decoder linear layers%s; %d norms / activations quantize for them",
            fp8,
            len(linears),
            f" (checkpoint quantization_config: {in_checkpoint})" if in_checkpoint else "",
            fused,
        )
    elif fused:
        logger.info("%d norms / activations quantize for int8 W8A8 layers", fused)
    return model.eval()
