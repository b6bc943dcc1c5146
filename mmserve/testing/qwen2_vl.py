"""Random Qwen2-VL / Qwen2.5-VL checkpoints (ViT + patch merger, Qwen2 text model with M-RoPE) written offline.

Presets: "tiny" / "tiny-2.5" for CPU tests (images of a few 14 px patches) and "qwen2-vl-7b" /
"qwen2.5-vl-7b" (real shapes and token ids, random bf16, written tensor by tensor) for benchmarks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    CLIP_MEAN,
    CLIP_STD,
    ParamSpec,
    check_layout,
    check_token_ids,
    decoder_kwargs,
    finish_config,
    param_specs,
    renamed,
    replace_sizes,
    round_up,
)
from mmserve.testing.tokenizer import build_bpe_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig

# version -> transformers (config, model = architecture in config.json, processor) class names
VERSIONS = {
    "2": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "2.5": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
}

# Qwen2's special tokens, in the order (and, after a 151643-token base vocab, at the ids) of the real tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's chat format: a default system turn, then per message its images/videos and text in order.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url', 'input_image') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Qwen2VLSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    version: str  # "2" (Qwen2-VL) | "2.5" (Qwen2.5-VL)
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    text_vocab: int  # base BPE vocab; the Qwen2 special tokens come right after it
    vocab_size: int | None  # model vocab; None = len(tokenizer) rounded up to vocab_multiple
    vocab_multiple: int
    max_position: int
    text_init_std: float
    rope_theta: float
    # sums to head_dim // 2: frequencies driven by t, h, w positions
    mrope_section: tuple[int, int, int]
    vision_embed: int  # ViT width
    vision_depth: int
    vision_heads: int
    vision_mlp_ratio: int  # Qwen2-VL: MLP width = vision_embed * ratio
    vision_intermediate: int  # Qwen2.5-VL: gated MLP width
    vision_act: str
    vision_init_std: float
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int  # image area bounds of the processor's smart resize
    max_pixels: int
    video_min_pixels: int  # per-frame area bounds for videos
    video_max_pixels: int
    dtype: str
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    window_size: int = 112  # Qwen2.5-VL: attention window side in pixels
    fullatt_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: blocks attending over the whole frame
    tokens_per_second: int = 2  # Qwen2.5-VL: temporal position step per second of video


PRESETS: dict[str, Qwen2VLSizes] = {
    "tiny": Qwen2VLSizes(
        version="2",
        text_hidden=80,
        text_layers=3,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=136,
        text_vocab=400,
        vocab_size=None,
        vocab_multiple=8,
        max_position=1024,
        text_init_std=0.2,
        rope_theta=1_000_000.0,
        mrope_section=(2, 4, 4),
        vision_embed=32,
        vision_depth=2,
        vision_heads=2,
        vision_mlp_ratio=2,
        vision_intermediate=0,
        vision_act="quick_gelu",
        vision_init_std=0.2,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=28 * 28,
        max_pixels=224 * 224,
        video_min_pixels=28 * 28,
        video_max_pixels=56 * 84,
        dtype="float32",
    ),
    "qwen2-vl-7b": Qwen2VLSizes(
        version="2",
        text_hidden=3584,
        text_layers=28,
        text_heads=28,
        text_kv_heads=4,
        text_intermediate=18944,
        text_vocab=151643,
        vocab_size=152064,
        vocab_multiple=128,
        max_position=32768,
        text_init_std=0.02,
        rope_theta=1_000_000.0,
        mrope_section=(16, 24, 24),
        vision_embed=1280,
        vision_depth=32,
        vision_heads=16,
        vision_mlp_ratio=4,
        vision_intermediate=0,
        vision_act="quick_gelu",
        vision_init_std=0.02,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 16384,
        video_min_pixels=128 * 28 * 28,
        video_max_pixels=768 * 28 * 28,
        dtype="bfloat16",
    ),
}
# windows of 2x2 merged tokens, so the tiny test images already span several, some partial
PRESETS["tiny-2.5"] = dataclasses.replace(
    PRESETS["tiny"],
    version="2.5",
    vision_act="silu",
    vision_intermediate=48,
    window_size=56,
    fullatt_blocks=(1,),
    tokens_per_second=25,
)  # video frames 2+ positions apart at the processor's default 24 fps
PRESETS["qwen2.5-vl-7b"] = dataclasses.replace(
    PRESETS["qwen2-vl-7b"],
    version="2.5",
    max_position=128000,
    vision_act="silu",
    vision_intermediate=3420,
    window_size=112,
    fullatt_blocks=(7, 15, 23, 31),
)


def qwen2_vl_sizes(preset: str = "tiny", **overrides: object) -> Qwen2VLSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`Qwen2VLSizes`) applied."""
    s = replace_sizes(PRESETS, preset, "qwen2_vl", overrides)
    s = dataclasses.replace(
        s, mrope_section=tuple(s.mrope_section), fullatt_blocks=tuple(s.fullatt_blocks)
    )
    if s.version not in VERSIONS:
        raise ValueError(f"version must be one of {sorted(VERSIONS)}, got {s.version!r}")
    head_dim = s.text_hidden // s.text_heads
    if sum(s.mrope_section) != head_dim // 2:
        raise ValueError(
            f"mrope_section {list(s.mrope_section)} must sum to head_dim // 2 = {head_dim // 2}"
        )
    return s


def token_ids(s: Qwen2VLSizes) -> dict[str, int]:
    """Ids of the special tokens: they follow the base vocab in SPECIAL_TOKENS order."""
    return {t: s.text_vocab + i for i, t in enumerate(SPECIAL_TOKENS)}


def _model_vocab(s: Qwen2VLSizes) -> int:
    if s.vocab_size is not None:
        return s.vocab_size
    n = s.text_vocab + len(SPECIAL_TOKENS)
    return round_up(n, s.vocab_multiple)


def _config_from_sizes(s: Qwen2VLSizes) -> Qwen2VLConfig:
    import transformers

    ids = token_ids(s)
    text = decoder_kwargs(
        s,
        _model_vocab(s),
        ids["<|endoftext|>"],
        ids["<|im_end|>"],
        ids["<|endoftext|>"],
        rope_parameters={
            "rope_type": "mrope",
            "mrope_section": list(s.mrope_section),
            "rope_theta": s.rope_theta,
        },
    )
    vision = dict(
        depth=s.vision_depth,
        num_heads=s.vision_heads,
        hidden_act=s.vision_act,
        patch_size=s.patch_size,
        temporal_patch_size=s.temporal_patch_size,
        spatial_merge_size=s.merge_size,
        initializer_range=s.vision_init_std,
    )
    if s.version == "2":
        vision.update(
            embed_dim=s.vision_embed, hidden_size=s.text_hidden, mlp_ratio=s.vision_mlp_ratio
        )
    else:
        vision.update(
            hidden_size=s.vision_embed,
            out_hidden_size=s.text_hidden,
            intermediate_size=s.vision_intermediate,
            window_size=s.window_size,
            fullatt_block_indexes=list(s.fullatt_blocks),
            tokens_per_second=s.tokens_per_second,
        )
    config_cls, arch, _ = VERSIONS[s.version]
    cfg = getattr(transformers, config_cls)(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=s.tie_word_embeddings,
    )
    return finish_config(cfg, arch, s.dtype)


def qwen2_vl_config(preset: str = "tiny", **overrides: object) -> Qwen2VLConfig:
    """The ``Qwen2VLConfig`` (``Qwen2_5_VLConfig`` for version "2.5") that :func:`make_qwen2_vl_checkpoint`
    writes for this preset (no weights built)."""
    return _config_from_sizes(qwen2_vl_sizes(preset, **overrides))


def checkpoint_key(name: str, layout: str = "hub") -> str:
    """Map a transformers-5 parameter name to the on-disk key: "transformers" keeps it (what
    ``save_pretrained`` of transformers 5.23 writes); "hub" is the published Qwen/Qwen2-VL layout."""
    if layout == "transformers":
        return name
    renames = (
        ("model.visual.", "visual."),
        ("model.language_model.", "model."),
        ("lm_head.", "lm_head."),
    )
    return renamed(name, "qwen2_vl", renames)


def _param_specs(config: Qwen2VLConfig, s: Qwen2VLSizes) -> list[ParamSpec]:
    """(name, shape, kind, std) for every saved tensor, from a meta-device model (no memory used).

    The text model's q/k/v biases stay random (they must load correctly); other biases are zeros.
    """
    import transformers

    def std_of(name: str) -> float:
        return s.vision_init_std if name.startswith("model.visual.") else s.text_init_std

    model_cls = getattr(transformers, VERSIONS[s.version][1])
    return param_specs(
        model_cls, config, std_of, random_bias=lambda name: name.startswith("model.language_model.")
    )


def _build_tokenizer(s: Qwen2VLSizes) -> PreTrainedTokenizerFast:
    from tokenizers import processors

    tok = build_bpe_tokenizer(
        SPECIAL_TOKENS,
        vocab_size=s.text_vocab,
        pad="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )
    tok.backend_tokenizer.post_processor = processors.ByteLevel(
        trim_offsets=False
    )  # Qwen2 adds no BOS
    tok.eos_token = "<|im_end|>"
    check_token_ids(tok, token_ids(s), {t: t for t in SPECIAL_TOKENS}, _model_vocab(s))
    return tok


def make_qwen2_vl_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random Qwen2-VL (or, for version "2.5" presets, Qwen2.5-VL) checkpoint (weights,
    config, tokenizer, processor) into ``out_dir``.

    ``overrides`` are :class:`Qwen2VLSizes` fields (text_hidden, text_layers, vision_depth, max_pixels,
    dtype, tie_word_embeddings, ...). Weights: N(0, std) for matrices, embeddings and the text model's
    q/k/v biases, ones for norm scales, zeros for the other biases; seeded per tensor, so a seed gives
    byte-identical files. ``layout``: "hub" (visual.* / model.* / lm_head.*, like the published repos)
    or "transformers" (model.visual.* / model.language_model.* / lm_head.*). The tokenizer is the small
    BPE plus Qwen2's special tokens right after the base vocab; for the 7b presets the base vocab is
    padded with unreachable fillers to 151643 so every special id matches the real checkpoint.
    """
    import transformers
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    check_layout(layout)
    s = qwen2_vl_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = _build_tokenizer(s)
    tok.chat_template = CHAT_TEMPLATE
    common = dict(
        patch_size=s.patch_size,
        temporal_patch_size=s.temporal_patch_size,
        merge_size=s.merge_size,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    image_processor = Qwen2VLImageProcessor(
        min_pixels=s.min_pixels, max_pixels=s.max_pixels, **common
    )
    video_processor = Qwen2VLVideoProcessor(
        min_pixels=s.video_min_pixels,
        max_pixels=s.video_max_pixels,
        cap_pixels_per_frame=False,
        **common,
    )
    processor_cls = getattr(transformers, VERSIONS[s.version][2])
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )
    specs = _param_specs(config, s)
    specs = _param_specs(config, s)
    key = partial(checkpoint_key, layout=layout)
    return write_checkpoint(out_dir, config, processor, specs, key, seed, max_shard_bytes)


CHECKPOINT_WRITERS = {"qwen2_vl": make_qwen2_vl_checkpoint}
TEST_CASES = {
    "qwen2_vl": FamilyCase(
        prompt="<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is {}?<|im_end|>\n"
        "<|im_start|>assistant\n",
        image_size=(56, 84),
        placeholder="<|vision_start|><|image_pad|><|vision_end|>",
        bench_input_len=56,
    )
}
