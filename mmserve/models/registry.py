"""Which of our model classes serves a HF checkpoint, by `config.architectures[0]`."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlavaForConditionalGeneration": ("mmserve.models.llava", "LlavaForConditionalGeneration"),
    "LlavaNextForConditionalGeneration": (
        "mmserve.models.llava_next",
        "LlavaNextForConditionalGeneration",
    ),
    "LlavaOnevisionForConditionalGeneration": (
        "mmserve.models.llava_onevision",
        "LlavaOnevisionForConditionalGeneration",
    ),
    "Qwen2VLForConditionalGeneration": (
        "mmserve.models.qwen2_vl",
        "Qwen2VLForConditionalGeneration",
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        "mmserve.models.qwen2_vl",
        "Qwen2_5_VLForConditionalGeneration",
    ),
    "Blip2ForConditionalGeneration": ("mmserve.models.blip2", "Blip2ForConditionalGeneration"),
    "MllamaForConditionalGeneration": ("mmserve.models.mllama", "MllamaForConditionalGeneration"),
    "FuyuForCausalLM": ("mmserve.models.fuyu", "FuyuForCausalLM"),
    "Kosmos2ForConditionalGeneration": (
        "mmserve.models.kosmos2",
        "Kosmos2ForConditionalGeneration",
    ),
    "VisionEncoderDecoderModel": ("mmserve.models.nougat", "NougatForConditionalGeneration"),
    "Pix2StructForConditionalGeneration": (
        "mmserve.models.pix2struct",
        "Pix2StructForConditionalGeneration",
    ),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(hf_config) -> type:
    """Our implementation of the checkpoint's architecture; ValueError naming it when unsupported."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if (
            arch == "Blip2ForConditionalGeneration"
            and getattr(hf_config.text_config, "model_type", "") == "t5"
        ):
            from mmserve.models.blip2_t5 import (
                Blip2T5ForConditionalGeneration,
            )  # BLIP-2 with Flan-T5

            return Blip2T5ForConditionalGeneration
        if (
            arch == "LlavaForConditionalGeneration"
            and getattr(getattr(hf_config, "vision_config", None), "model_type", "") == "pixtral"
        ):
            from mmserve.models.pixtral import (
                PixtralForConditionalGeneration,
            )  # LLaVA with Pixtral's tower

            return PixtralForConditionalGeneration
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"architecture {archs[0] if archs else '(none given in config.json)'!r} is not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
