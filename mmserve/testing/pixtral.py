"""Random Pixtral checkpoints (transformers' `LlavaForConditionalGeneration` with a `PixtralVisionModel` tower and
a Mistral text model, as mistral-community/pixtral-12b) written offline.

Presets: "tiny" (CPU tests: 16 px patches, images scaled to at most 64 px, i.e. up to 4x4 patches) and
"pixtral-12b" (real shapes, random bf16, written tensor by tensor; its token ids are the small BPE's, not
Tekken's). Tensor names are the published repo's (`vision_tower.`, `language_model.model.`, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.testing.cases import FamilyCase
from mmserve.testing.llava import checkpoint_key, feature_layer, llava_param_specs
from mmserve.testing.recipe import (
    CLIP_MEAN,
    CLIP_STD,
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
    from transformers import LlavaConfig, PreTrainedTokenizerFast

IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
# Pixtral's prompt format: "[INST]" + the user turn's parts in order (an image is "[IMG]") + "[/INST]";
# BOS comes from the tokenizer
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if content is string -%}{{- content + '\\n\\n' -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] + '\\n\\n' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST]' -}}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] in ('image', 'image_url', 'input_image') -%}{{- '[IMG]' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '[/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -}}"
    "{%- endif -%}"
    "{{- '__EOS__' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


@dataclass(frozen=True)
class PixtralSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_intermediate: int
    text_vocab: int  # base BPE vocab; [IMG], [IMG_BREAK], [IMG_END] and <pad> come right after it
    model_vocab: int  # 0: len(tokenizer) rounded up to 8
    max_position: int
    text_init_std: float
    rope_theta: float
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int  # the tower's largest side, and the processor's longest_edge
    patch_size: int
    vision_init_std: float
    vision_feature_layer: int | tuple[int, ...]
    dtype: str
    vision_act: str = "silu"
    vision_rope_theta: float = 10000.0
    projector_act: str = "gelu"
    rms_norm_eps: float = 1e-5


PRESETS: dict[str, PixtralSizes] = {
    "tiny": PixtralSizes(
        text_hidden=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        text_head_dim=16,
        text_intermediate=128,
        text_vocab=400,
        model_vocab=0,
        max_position=1024,
        text_init_std=0.2,
        rope_theta=10000.0,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        vision_intermediate=64,
        image_size=64,
        patch_size=16,
        vision_init_std=0.2,
        vision_feature_layer=-1,
        dtype="float32",
    ),
    "pixtral-12b": PixtralSizes(
        text_hidden=5120,
        text_layers=40,
        text_heads=32,
        text_kv_heads=8,
        text_head_dim=128,
        text_intermediate=14336,
        text_vocab=400,
        model_vocab=131072,
        max_position=1024000,
        text_init_std=0.02,
        rope_theta=1_000_000_000.0,
        vision_hidden=1024,
        vision_layers=24,
        vision_heads=16,
        vision_intermediate=4096,
        image_size=1024,
        patch_size=16,
        vision_init_std=0.02,
        vision_feature_layer=-1,
        dtype="bfloat16",
    ),
}
# two feature layers, a head_dim other than hidden / heads (as pixtral-12b's text model has)
PRESETS["tiny-two-layers"] = dataclasses.replace(
    PRESETS["tiny"], vision_feature_layer=(-2, -1), text_head_dim=24
)


def pixtral_sizes(preset: str = "tiny", **overrides: object) -> PixtralSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`PixtralSizes`) applied."""
    return replace_sizes(PRESETS, preset, "pixtral", overrides)


def pixtral_token_ids(text_vocab: int) -> dict[str, int]:
    """Ids of the tokenizer: unk, bos, eos first; [IMG], [IMG_BREAK], [IMG_END], <pad> after the base ids."""
    return bpe_token_ids(text_vocab, ("image", "image_break", "image_end", "pad"))


def _model_vocab(s: PixtralSizes) -> int:
    return s.model_vocab or round_up(s.text_vocab + 4, 8)


def _config_from_sizes(s: PixtralSizes) -> LlavaConfig:
    from transformers import LlavaConfig, MistralConfig, PixtralVisionConfig

    ids = pixtral_token_ids(s.text_vocab)
    text = MistralConfig(
        **decoder_kwargs(
            s,
            _model_vocab(s),
            ids["bos"],
            ids["eos"],
            ids["pad"],
            head_dim=s.text_head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
            sliding_window=None,
            tie_word_embeddings=False,
        )
    )
    vision = PixtralVisionConfig(
        **vit_kwargs(s),
        hidden_act=s.vision_act,
        rope_parameters={"rope_type": "axial", "rope_theta": s.vision_rope_theta},
        initializer_range=s.vision_init_std,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=ids["image"],
        projector_hidden_act=s.projector_act,
        vision_feature_layer=feature_layer(s.vision_feature_layer),
        vision_feature_select_strategy="full",
        multimodal_projector_bias=True,
        tie_word_embeddings=False,
    )
    return finish_config(cfg, "LlavaForConditionalGeneration", s.dtype)


def pixtral_config(preset: str = "tiny", **overrides: object) -> LlavaConfig:
    """The ``LlavaConfig`` that :func:`make_pixtral_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(pixtral_sizes(preset, **overrides))


def build_pixtral_tokenizer(text_vocab: int, model_vocab: int) -> PreTrainedTokenizerFast:
    """The small BPE with [IMG], [IMG_BREAK], [IMG_END] (special) and <pad> after ``text_vocab`` base ids."""
    tok = build_bpe_tokenizer([IMAGE_TOKEN, BREAK_TOKEN, END_TOKEN], vocab_size=text_vocab)
    names = {"image": IMAGE_TOKEN, "image_break": BREAK_TOKEN, "image_end": END_TOKEN}
    check_token_ids(tok, pixtral_token_ids(text_vocab), names, model_vocab)
    tok.chat_template = CHAT_TEMPLATE.replace("__EOS__", tok.eos_token)
    return tok


def make_pixtral_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random Pixtral checkpoint into ``out_dir`` and return its path.

    ``overrides`` are :class:`PixtralSizes` fields. Weights: N(0, std) for matrices and embeddings
    (vision_init_std for the tower, text_init_std for the rest), ones for RMSNorm scales, zeros for the projector's
    biases; seeded per tensor. The processor is transformers' `PixtralProcessor` (patch_size, longest_edge =
    the tower's image_size) over the small BPE.
    """
    from transformers import LlavaForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    s = pixtral_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = build_pixtral_tokenizer(s.text_vocab, config.text_config.vocab_size)
    image_processor = PixtralImageProcessor(
        size={"longest_edge": s.image_size},
        patch_size={"height": s.patch_size, "width": s.patch_size},
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    processor = PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=s.patch_size,
        spatial_merge_size=1,
        chat_template=tok.chat_template,
        image_token=IMAGE_TOKEN,
        image_break_token=BREAK_TOKEN,
        image_end_token=END_TOKEN,
    )
    specs = llava_param_specs(LlavaForConditionalGeneration, config, s)
    # the published layout: what transformers 5 `save_pretrained` writes for a tower without a `vision_model.`
    key = partial(checkpoint_key, layout="transformers")
    return write_checkpoint(out_dir, config, processor, specs, key, seed, max_shard_bytes)


CHECKPOINT_WRITERS = {"pixtral": make_pixtral_checkpoint}
# expansions are rows of [IMG] closed by [IMG_BREAK], the last by [IMG_END]
TEST_CASES = {
    "pixtral": FamilyCase(
        prompt="[INST][IMG]tell me about {}[/INST]", image_size=(40, 56), placeholder="[IMG]"
    )
}
