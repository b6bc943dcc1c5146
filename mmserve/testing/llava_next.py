"""Random llava-hf style LLaVA-NeXT (llava-v1.6) checkpoints (CLIP + Mistral/Llama) written offline.

Presets: "tiny" (CPU tests: 42 px tiles of 6x6 patches, a mosaic of at most 3 tiles) and
"llava-v1.6-mistral-7b" (real shapes, random fp16, written tensor by tensor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.testing.cases import FamilyCase
from mmserve.testing.llava import (
    build_llava_tokenizer,
    checkpoint_key,
    clip_vision_config,
    feature_layer,
    llama_text_kwargs,
    llava_param_specs,
    llava_token_ids,
)
from mmserve.testing.recipe import CLIP_MEAN, CLIP_STD, check_layout, finish_config, replace_sizes
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import LlavaNextConfig

# llava-v1.6-mistral prompt format: "[INST] <image>\nWhat is shown? [/INST]" (BOS comes from the tokenizer)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if content is string -%}{{- content + '\\n\\n' -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] + '\\n\\n' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST] ' -}}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}"
    "{%- for part in content if part['type'] in ('image', 'image_url', 'input_image') -%}"
    "{{- '<image>\\n' -}}{%- endfor -%}"
    "{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -}}"
    "{%- endif -%}"
    "{{- ' [/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if content is string -%}{{- ' ' + content -}}"
    "{%- else -%}{{- ' ' + content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -}}"
    "{%- endif -%}"
    "{{- '__EOS__' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def _scaled_pinpoints(
    tile: int, shapes: tuple[tuple[int, int], ...]
) -> tuple[tuple[int, int], ...]:
    return tuple((r * tile, c * tile) for r, c in shapes)


NEXT_MOSAICS = ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))  # llava-v1.6 pinpoints, in tiles


@dataclass(frozen=True)
class LlavaNextSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_model: str  # "mistral" | "llama"
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    text_vocab: int  # base BPE vocab; "<image>" and "<pad>" come right after it
    vocab_multiple: int
    max_position: int
    text_init_std: float
    rope_theta: float
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    vision_projection_dim: int
    image_size: int
    patch_size: int
    vision_init_std: float
    vision_feature_layer: int | tuple[int, ...]
    grid_pinpoints: tuple[tuple[int, int], ...]
    dtype: str
    vision_act: str = "quick_gelu"
    projector_act: str = "gelu"
    rms_norm_eps: float = 1e-5


PRESETS: dict[str, LlavaNextSizes] = {
    "tiny": LlavaNextSizes(
        text_model="mistral",
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
        vision_projection_dim=32,
        image_size=42,
        patch_size=7,
        vision_init_std=0.2,
        vision_feature_layer=-2,
        grid_pinpoints=_scaled_pinpoints(42, NEXT_MOSAICS),
        dtype="float32",
    ),
    "llava-v1.6-mistral-7b": LlavaNextSizes(
        text_model="mistral",
        text_hidden=4096,
        text_layers=32,
        text_heads=32,
        text_kv_heads=8,
        text_intermediate=14336,
        text_vocab=32000,
        vocab_multiple=64,
        max_position=32768,
        text_init_std=0.02,
        rope_theta=1_000_000.0,
        vision_hidden=1024,
        vision_layers=24,
        vision_heads=16,
        vision_intermediate=4096,
        vision_projection_dim=768,
        image_size=336,
        patch_size=14,
        vision_init_std=0.02,
        vision_feature_layer=-2,
        grid_pinpoints=_scaled_pinpoints(336, NEXT_MOSAICS),
        dtype="float16",
    ),
}
PRESETS["tiny-llama"] = dataclasses.replace(
    PRESETS["tiny"], text_model="llama", text_kv_heads=4, vision_feature_layer=(-2, -1)
)


def llava_next_sizes(preset: str = "tiny", **overrides: object) -> LlavaNextSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`LlavaNextSizes`) applied."""
    return replace_sizes(PRESETS, preset, "llava_next", overrides)


def _config_from_sizes(s: LlavaNextSizes) -> LlavaNextConfig:
    from transformers import LlamaConfig, LlavaNextConfig, MistralConfig

    if s.text_model == "mistral":
        text = MistralConfig(sliding_window=None, **llama_text_kwargs(s))
    elif s.text_model == "llama":
        text = LlamaConfig(**llama_text_kwargs(s))
    else:
        raise ValueError(f"text_model must be 'mistral' or 'llama', got {s.text_model!r}")
    cfg = LlavaNextConfig(
        vision_config=clip_vision_config(s),
        text_config=text,
        image_token_index=llava_token_ids(s.text_vocab)["image"],
        image_grid_pinpoints=[list(p) for p in s.grid_pinpoints],
        projector_hidden_act=s.projector_act,
        vision_feature_layer=feature_layer(s.vision_feature_layer),
        vision_feature_select_strategy="default",
        image_seq_length=(s.image_size // s.patch_size) ** 2,
        tie_word_embeddings=False,
    )
    return finish_config(cfg, "LlavaNextForConditionalGeneration", s.dtype)


def llava_next_config(preset: str = "tiny", **overrides: object) -> LlavaNextConfig:
    """The ``LlavaNextConfig`` that :func:`make_llava_next_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(llava_next_sizes(preset, **overrides))


def next_checkpoint_key(name: str, layout: str = "hub") -> str:
    """transformers-5 parameter name -> on-disk key ("hub": published llava-hf layout; "transformers": 5.23's)."""
    if name == "model.image_newline":
        return "image_newline"
    return checkpoint_key(name, layout)


def make_llava_next_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random llava-hf style LLaVA-NeXT checkpoint into ``out_dir`` and return its path.

    ``overrides`` are :class:`LlavaNextSizes` fields. Weights: N(0, std) for matrices and embeddings
    (vision_init_std for CLIP, text_init_std for the rest, 1/sqrt(hidden) for image_newline as HF inits
    it), ones/zeros for norms, zeros for biases; seeded per tensor. ``layout``: "hub" (published
    llava-hf names) or "transformers" (5.23 ``save_pretrained`` names). The tokenizer is the small BPE,
    padded with filler tokens to ``text_vocab`` base ids (so ``<image>`` = 32000 for the 7B preset).
    """
    from transformers import (
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    check_layout(layout)
    s = llava_next_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = build_llava_tokenizer(s.text_vocab, config.text_config.vocab_size, CHAT_TEMPLATE)
    image_processor = LlavaNextImageProcessor(
        size={"shortest_edge": s.image_size},
        crop_size={"height": s.image_size, "width": s.image_size},
        image_grid_pinpoints=[list(p) for p in s.grid_pinpoints],
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        do_pad=True,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=s.patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    )
    specs = llava_param_specs(LlavaNextForConditionalGeneration, config, s)
    key = partial(next_checkpoint_key, layout=layout)
    return write_checkpoint(out_dir, config, processor, specs, key, seed, max_shard_bytes)


CHECKPOINT_WRITERS = {"llava_next": make_llava_next_checkpoint}
TEST_CASES = {
    "llava_next": FamilyCase(
        prompt="[INST] <image>\ntell me about {} [/INST]",
        image_size=(50, 70),
        placeholder="<image>",
    )
}
