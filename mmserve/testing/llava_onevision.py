"""Random llava-hf style LLaVA-OneVision checkpoints (SigLIP + Qwen2) with image and video processors.

Presets: "tiny" (CPU tests: 42 px tiles of 6x6 patches, anyres_max_2 so downscaling shows up on small
mosaics) and "llava-onevision-qwen2-7b-ov" (real shapes, random fp16, written tensor by tensor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.testing.cases import FamilyCase
from mmserve.testing.llava import feature_layer, llava_param_specs
from mmserve.testing.llava_next import next_checkpoint_key
from mmserve.testing.recipe import (
    check_layout,
    check_token_ids,
    decoder_kwargs,
    finish_config,
    replace_sizes,
    round_up,
    vit_kwargs,
)
from mmserve.testing.tokenizer import bpe_token_ids, build_bpe_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import LlavaOnevisionConfig

IMAGE_TOKEN, VIDEO_TOKEN, IM_START, IM_END = "<image>", "<video>", "<|im_start|>", "<|im_end|>"
SIGLIP_MEAN = SIGLIP_STD = [0.5, 0.5, 0.5]

# Qwen chat format of llava-onevision-qwen2-*-ov-hf: "<|im_start|>user <image>\ntext<|im_end|>\n<|im_start|>assistant\n"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + ' ' -}}"
    "{%- set content = message['content'] -%}"
    "{%- if content is string -%}{{- '\\n' + content -}}"
    "{%- else -%}"
    "{%- for part in content if part['type'] in ('image', 'image_url', 'input_image') -%}"
    "{{- '<image>' -}}{%- endfor -%}"
    "{%- for part in content if part['type'] == 'video' -%}{{- '<video>' -}}{%- endfor -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{- '\\n' + part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _pinpoints(tile: int, max_side: int) -> tuple[tuple[int, int], ...]:
    """Every mosaic of 1..max_side tiles down and across, as OneVision lists them."""
    return tuple(
        (r * tile, c * tile) for r in range(1, max_side + 1) for c in range(1, max_side + 1)
    )


@dataclass(frozen=True)
class LlavaOnevisionSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    text_vocab: int  # base BPE vocab; <image>, <video>, <|im_start|>, <pad> come right after it
    vocab_multiple: int
    max_position: int
    text_init_std: float
    rope_theta: float
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int
    patch_size: int
    vision_init_std: float
    grid_pinpoints: tuple[tuple[int, int], ...]
    vision_aspect_ratio: str
    dtype: str
    model_vocab: int | None = None  # None: the tokenizer's size rounded up to vocab_multiple
    tie_word_embeddings: bool = False
    vision_feature_layer: int | tuple[int, ...] = -1
    vision_act: str = "gelu_pytorch_tanh"
    projector_act: str = "gelu"
    rms_norm_eps: float = 1e-6


PRESETS: dict[str, LlavaOnevisionSizes] = {
    "tiny": LlavaOnevisionSizes(
        text_hidden=80,
        text_layers=3,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=136,
        text_vocab=400,
        vocab_multiple=8,
        max_position=1024,
        text_init_std=0.2,
        rope_theta=10000.0,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        vision_intermediate=64,
        image_size=42,
        patch_size=7,
        vision_init_std=0.2,
        grid_pinpoints=_pinpoints(42, 3),
        vision_aspect_ratio="anyres_max_2",
        dtype="float32",
    ),
    "llava-onevision-qwen2-7b-ov": LlavaOnevisionSizes(
        text_hidden=3584,
        text_layers=28,
        text_heads=28,
        text_kv_heads=4,
        text_intermediate=18944,
        text_vocab=151646,
        vocab_multiple=64,
        max_position=32768,
        text_init_std=0.02,
        rope_theta=1_000_000.0,
        vision_hidden=1152,
        vision_layers=26,
        vision_heads=16,
        vision_intermediate=4304,
        image_size=384,
        patch_size=14,
        vision_init_std=0.02,
        grid_pinpoints=_pinpoints(384, 6),
        vision_aspect_ratio="anyres_max_9",
        dtype="float16",
        model_vocab=152128,
    ),
}
PRESETS["tiny-tied"] = dataclasses.replace(
    PRESETS["tiny"], tie_word_embeddings=True, vision_feature_layer=(-2, -1)
)


def llava_onevision_sizes(preset: str = "tiny", **overrides: object) -> LlavaOnevisionSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`LlavaOnevisionSizes`) applied."""
    return replace_sizes(PRESETS, preset, "llava_onevision", overrides)


def token_ids(s: LlavaOnevisionSizes) -> dict[str, int]:
    """Ids of the tokenizer: unk, bos, eos first; <image>, <video>, <|im_start|>, <pad> after the base ids."""
    return bpe_token_ids(s.text_vocab, ("image", "video", "im_start", "pad"))


def _config_from_sizes(s: LlavaOnevisionSizes) -> LlavaOnevisionConfig:
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    ids = token_ids(s)
    vocab = s.model_vocab or round_up(s.text_vocab + 4, s.vocab_multiple)
    if vocab < s.text_vocab + 4:
        raise ValueError(
            f"model_vocab {vocab} is smaller than the tokenizer ({s.text_vocab + 4} tokens)"
        )
    text = Qwen2Config(
        **decoder_kwargs(
            s,
            vocab,
            ids["bos"],
            ids["eos"],
            ids["pad"],
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
            tie_word_embeddings=s.tie_word_embeddings,
            use_sliding_window=False,
        )
    )
    vision = SiglipVisionConfig(
        **vit_kwargs(s), hidden_act=s.vision_act, layer_norm_eps=1e-6, vision_use_head=False
    )
    cfg = LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["image"],
        video_token_index=ids["video"],
        image_grid_pinpoints=[list(p) for p in s.grid_pinpoints],
        vision_aspect_ratio=s.vision_aspect_ratio,
        projector_hidden_act=s.projector_act,
        vision_feature_layer=feature_layer(s.vision_feature_layer),
        vision_feature_select_strategy="full",
        tie_word_embeddings=s.tie_word_embeddings,
    )
    return finish_config(cfg, "LlavaOnevisionForConditionalGeneration", s.dtype)


def llava_onevision_config(preset: str = "tiny", **overrides: object) -> LlavaOnevisionConfig:
    """The ``LlavaOnevisionConfig`` that :func:`make_llava_onevision_checkpoint` writes (no weights built)."""
    return _config_from_sizes(llava_onevision_sizes(preset, **overrides))


def make_llava_onevision_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random llava-hf style LLaVA-OneVision checkpoint into ``out_dir`` and return its path.

    ``overrides`` are :class:`LlavaOnevisionSizes` fields; weights as in
    :func:`~mmserve.testing.llava_next.make_llava_next_checkpoint`. The tokenizer is the small BPE with
    ``<image>``, ``<video>``, ``<|im_start|>`` and ``<pad>`` after ``text_vocab`` base ids (so ``<image>``
    = 151646 and ``<video>`` = 151647 for the 7B preset); EOS is ``<|im_end|>``.
    """
    from transformers import (
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    check_layout(layout)
    s = llava_onevision_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = build_bpe_tokenizer(
        [IMAGE_TOKEN, VIDEO_TOKEN, IM_START],
        vocab_size=s.text_vocab,
        bos="<|endoftext|>",
        eos=IM_END,
        extra_special_tokens={"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
    )
    check_token_ids(
        tok,
        token_ids(s),
        {"image": IMAGE_TOKEN, "video": VIDEO_TOKEN, "im_start": IM_START},
        config.text_config.vocab_size,
    )
    tok.chat_template = CHAT_TEMPLATE
    size = {"height": s.image_size, "width": s.image_size}
    image_processor = LlavaOnevisionImageProcessor(
        size=size,
        image_grid_pinpoints=[list(p) for p in s.grid_pinpoints],
        image_mean=SIGLIP_MEAN,
        image_std=SIGLIP_STD,
        do_pad=True,
    )
    video_processor = LlavaOnevisionVideoProcessor(
        size=size, image_mean=SIGLIP_MEAN, image_std=SIGLIP_STD
    )
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        num_image_tokens=(s.image_size // s.patch_size) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=s.vision_aspect_ratio,
        chat_template=CHAT_TEMPLATE,
    )
    specs = llava_param_specs(LlavaOnevisionForConditionalGeneration, config, s)
    key = partial(next_checkpoint_key, layout=layout)
    return write_checkpoint(out_dir, config, processor, specs, key, seed, max_shard_bytes)


CHECKPOINT_WRITERS = {"llava_onevision": make_llava_onevision_checkpoint}
TEST_CASES = {
    "llava_onevision": FamilyCase(
        prompt="<|im_start|>user <image>\nwhat is {}<|im_end|>\n<|im_start|>assistant\n",
        image_size=(50, 70),
        placeholder="<image>",
    )
}
