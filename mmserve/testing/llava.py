"""Random llava-hf style LLaVA-1.5 checkpoints (CLIP vision tower + Llama text model) written offline.

Presets: "tiny" / "tiny-mha" for CPU tests and "llava-1.5-7b" (real shapes, random fp16) for benchmarks.
LLaVA-NeXT and LLaVA-OneVision reuse its tokenizer, text / CLIP configs, tensor names and init stds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    HUB_TEXT_NAMES,
    ParamSpec,
    check_layout,
    check_token_ids,
    clip_image_processor,
    decoder_kwargs,
    finish_config,
    param_specs,
    renamed,
    replace_sizes,
    round_up,
    vit_kwargs,
)
from mmserve.testing.tokenizer import bpe_token_ids, build_bpe_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        PreTrainedConfig,
        PreTrainedTokenizerFast,
    )

    from mmserve.testing.llava_next import LlavaNextSizes
    from mmserve.testing.llava_onevision import LlavaOnevisionSizes

IMAGE_TOKEN = "<image>"
# llava-1.5 prompt format: images of a user turn first (one "<image>\n" each), then its text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if content is string -%}{{- content + ' ' -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] + ' ' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- 'USER: ' -}}"
    "{%- if content is string -%}{{- content + ' ' -}}"
    "{%- else -%}"
    "{%- for part in content if part['type'] in ('image', 'image_url', 'input_image') -%}"
    "{{- '<image>\\n' -}}{%- endfor -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{- part['text'] + ' ' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- 'ASSISTANT: ' -}}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -}}"
    "{%- endif -%}"
    "{{- '__EOS__' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class LlavaSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    text_vocab: int  # base BPE vocab; "<image>" and "<pad>" come right after it
    vocab_multiple: int  # model vocab = len(tokenizer) rounded up to this
    max_position: int
    text_init_std: float
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    vision_projection_dim: int
    image_size: int
    patch_size: int
    vision_act: str
    vision_init_std: float
    vision_feature_layer: int | tuple[int, ...]
    vision_feature_select_strategy: str
    projector_act: str
    dtype: str
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


PRESETS: dict[str, LlavaSizes] = {
    "tiny": LlavaSizes(
        text_hidden=80,
        text_layers=3,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=136,
        text_vocab=400,
        vocab_multiple=8,
        max_position=512,
        text_init_std=0.2,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        vision_intermediate=64,
        vision_projection_dim=32,
        image_size=42,
        patch_size=14,
        vision_act="quick_gelu",
        vision_init_std=0.2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_act="gelu",
        dtype="float32",
    ),
    "llava-1.5-7b": LlavaSizes(
        text_hidden=4096,
        text_layers=32,
        text_heads=32,
        text_kv_heads=32,
        text_intermediate=11008,
        text_vocab=32000,
        vocab_multiple=64,
        max_position=4096,
        text_init_std=0.02,
        vision_hidden=1024,
        vision_layers=24,
        vision_heads=16,
        vision_intermediate=4096,
        vision_projection_dim=768,
        image_size=336,
        patch_size=14,
        vision_act="quick_gelu",
        vision_init_std=0.02,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_act="gelu",
        dtype="float16",
    ),
}
PRESETS["tiny-mha"] = dataclasses.replace(
    PRESETS["tiny"],
    text_kv_heads=4,
    vision_feature_layer=(-2, -1),
    vision_feature_select_strategy="full",
)


def llava_sizes(preset: str = "tiny", **overrides: object) -> LlavaSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`LlavaSizes`) applied."""
    return replace_sizes(PRESETS, preset, "llava", overrides)


def image_tokens_per_image(s: LlavaSizes) -> int:
    """Placeholder tokens one image expands to (CLS dropped by the "default" strategy)."""
    n = (s.image_size // s.patch_size) ** 2
    return n if s.vision_feature_select_strategy == "default" else n + 1


def llava_token_ids(text_vocab: int) -> dict[str, int]:
    """Ids of the llava tokenizer: unk, bos, eos first; image, pad right after the ``text_vocab`` base ids."""
    return bpe_token_ids(text_vocab, ("image", "pad"))


def llama_text_kwargs(s: LlavaSizes | LlavaNextSizes) -> dict[str, object]:
    """LlamaConfig / MistralConfig keywords of the text model: vocab = the tokenizer's, rounded up to
    ``vocab_multiple``; special ids of :func:`llava_token_ids`; shared with LLaVA-NeXT."""
    ids = llava_token_ids(s.text_vocab)
    return decoder_kwargs(
        s,
        round_up(s.text_vocab + 2, s.vocab_multiple),
        ids["bos"],
        ids["eos"],
        ids["pad"],
        head_dim=s.text_hidden // s.text_heads,
        rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
        tie_word_embeddings=False,
    )


def clip_vision_config(s: LlavaSizes | LlavaNextSizes) -> CLIPVisionConfig:
    """The CLIP vision tower's config; shared with LLaVA-NeXT."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(
        **vit_kwargs(s),
        projection_dim=s.vision_projection_dim,
        hidden_act=s.vision_act,
        layer_norm_eps=1e-5,
        initializer_range=s.vision_init_std,
    )


def feature_layer(layer: int | tuple[int, ...]) -> int | list[int]:
    """A sizes' ``vision_feature_layer`` as the llava configs take it (several layers: a list)."""
    return list(layer) if isinstance(layer, tuple) else layer


def _config_from_sizes(s: LlavaSizes) -> LlavaConfig:
    from transformers import LlamaConfig, LlavaConfig

    cfg = LlavaConfig(
        vision_config=clip_vision_config(s),
        text_config=LlamaConfig(**llama_text_kwargs(s)),
        image_token_index=llava_token_ids(s.text_vocab)["image"],
        image_seq_length=image_tokens_per_image(s),
        projector_hidden_act=s.projector_act,
        vision_feature_layer=feature_layer(s.vision_feature_layer),
        vision_feature_select_strategy=s.vision_feature_select_strategy,
        tie_word_embeddings=False,
    )
    return finish_config(cfg, "LlavaForConditionalGeneration", s.dtype)


def llava_config(preset: str = "tiny", **overrides: object) -> LlavaConfig:
    """The ``LlavaConfig`` that :func:`make_llava_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(llava_sizes(preset, **overrides))


def checkpoint_key(name: str, layout: str = "hub") -> str:
    """Map a transformers-5 parameter name to the on-disk key.

    "hub" is the layout of the published llava-hf checkpoints; "transformers" is what
    ``save_pretrained`` of transformers 5.23 writes (CLIP's ``vision_model.`` prefix dropped).
    """
    vision = "vision_tower.vision_model." if layout == "hub" else "vision_tower."
    renames = (
        *HUB_TEXT_NAMES,
        ("model.vision_tower.", vision),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    return renamed(name, "llava", renames)


def llava_param_specs(
    model_cls: type, config: PreTrainedConfig, s: LlavaSizes | LlavaNextSizes | LlavaOnevisionSizes
) -> list[ParamSpec]:
    """:func:`~mmserve.testing.writer.param_specs` of the llava families. Init std: vision_init_std for
    the vision tower, 1/sqrt(text_hidden) for LLaVA-NeXT/OneVision's image_newline (as HF inits it),
    text_init_std otherwise."""

    def std_of(name: str) -> float:
        if name == "model.image_newline":
            return 1 / math.sqrt(s.text_hidden)
        return s.vision_init_std if name.startswith("model.vision_tower.") else s.text_init_std

    return param_specs(model_cls, config, std_of)


def build_llava_tokenizer(
    text_vocab: int, model_vocab: int, chat_template: str
) -> PreTrainedTokenizerFast:
    """The small BPE with ``<image>``, ``<pad>`` after ``text_vocab`` base ids (the ids of :func:`llava_token_ids`)
    and ``chat_template`` (its ``__EOS__`` replaced by the EOS token) set; shared with LLaVA-NeXT."""
    tok = build_bpe_tokenizer(
        [IMAGE_TOKEN], vocab_size=text_vocab, extra_special_tokens={"image_token": IMAGE_TOKEN}
    )
    check_token_ids(tok, llava_token_ids(text_vocab), {"image": IMAGE_TOKEN}, model_vocab)
    tok.chat_template = chat_template.replace("__EOS__", tok.eos_token)
    return tok


def make_llava_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random llava-hf style checkpoint into ``out_dir`` and return its path.

    ``overrides`` are :class:`LlavaSizes` fields (text_hidden, text_layers, text_heads, text_kv_heads,
    text_intermediate, vision_hidden, vision_layers, image_size, dtype, ...). Weights: N(0, std) for
    matrices and embeddings (std = text_init_std for the text model and projector, vision_init_std for
    CLIP), ones for norm scales, zeros for biases; seeded per tensor so a seed gives byte-identical
    files. ``layout`` picks the tensor names: "hub" (like the published llava-hf repos) or
    "transformers" (like transformers 5.23 ``save_pretrained``). The tokenizer is always the small
    BPE; for "llava-1.5-7b" it is padded with unreachable filler tokens to 32000 base ids so that
    ``<image>`` = 32000, ``<pad>`` = 32001 and the model vocab (32064) exceed the tokenizer as in llava-hf.
    """
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    check_layout(layout)
    s = llava_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = build_llava_tokenizer(s.text_vocab, config.text_config.vocab_size, CHAT_TEMPLATE)
    image_processor = clip_image_processor(s.image_size, center_crop=True)
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=s.patch_size,
        vision_feature_select_strategy=s.vision_feature_select_strategy,
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    )
    specs = llava_param_specs(LlavaForConditionalGeneration, config, s)
    key = partial(checkpoint_key, layout=layout)
    return write_checkpoint(out_dir, config, processor, specs, key, seed, max_shard_bytes)


CHECKPOINT_WRITERS = {"llava": make_llava_checkpoint}
TEST_CASES = {"llava": FamilyCase(placeholder="<image>")}
