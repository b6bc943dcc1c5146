"""Random Llama-3.2-Vision (Mllama: tiled ViT with a local + a gated global encoder, Llama 3 text model with
gated cross-attention layers) checkpoints with an MllamaProcessor, written offline.

Presets: "tiny" for CPU tests (28 px tiles of 2x2 patches, up to 4 tiles) and "llama-3.2-11b-vision" (real
shapes and special token ids, random bf16, written tensor by tensor) for benchmarks.

The tokenizer follows Llama 3's layout: the base vocab, then a block of special tokens ending at the text
vocab size (``<|begin_of_text|>`` first, ``<|finetune_right_pad_id|>`` at +4, headers at +6/+7,
``<|eot_id|>`` at +9, the rest reserved), then ``<|image|>`` = text vocab size. ``<|image|>`` lives in the
8 extra rows of ``embed_tokens`` (vocab_size + 8 rows) that ``lm_head`` (vocab_size rows) never produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    CLIP_MEAN,
    CLIP_STD,
    HUB_TEXT_NAMES,
    ParamSpec,
    check_divides,
    check_layout,
    check_roles,
    decoder_kwargs,
    finish_config,
    param_specs,
    renamed,
    replace_sizes,
    round_up,
)
from mmserve.testing.tokenizer import build_bpe_tokenizer, named_ids, token_block
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import MllamaConfig, PreTrainedTokenizerFast

IMAGE_TOKEN = "<|image|>"
# Llama 3's named special tokens by offset from the base vocab; every other offset below the text vocab size
# holds a "<|reserved_special_token_<i>|>", numbered in id order as in the real tokenizer.
NAMED_SPECIALS = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    4: "<|finetune_right_pad_id|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
BOS, EOS, PAD = "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"
# generation stops on any of these (as Llama-3.2-11B-Vision-Instruct's config); the tokenizer's EOS is <|eot_id|>
STOP_TOKENS = ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")

# Llama 3 chat format, "<|start_header_id|>role<|end_header_id|>\n\n" + content + "<|eot_id|>" per message, with
# one <|image|> per image part of a message before its text. The tokenizer adds <|begin_of_text|> (so the
# template does not); MllamaProcessor also inserts a <|begin_of_text|> into prompts without one (see
# build_string_from_input), so image prompts from this template start with two.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{%- if content is string -%}{{- content | trim -}}"
    "{%- else -%}"
    "{%- for part in content if part['type'] in ('image', 'image_url', 'input_image') -%}"
    "{{- '<|image|>' -}}{%- endfor -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# tanh gates, drawn N(0, gate_std). HF zero-initialises the first five (a fresh model would ignore the image and
# the tile embeddings) and draws the global encoder's N(0, initializer_range) (nearly closed at a small std).
GATES = (
    "cross_attn_attn_gate",
    "cross_attn_mlp_gate",
    "gated_positional_embedding.gate",
    "pre_tile_positional_embedding.gate",
    "post_tile_positional_embedding.gate",
    "gate_attn",
    "gate_ffn",
)


@dataclass(frozen=True)
class MllamaSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    # text layers that cross-attend to the image (no self-attention)
    cross_attention_layers: tuple[int, ...]
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    text_vocab: int  # base BPE vocab; Llama 3's special-token block follows it
    # model vocab = base + named specials, rounded up to this (reserved tokens fill)
    vocab_multiple: int
    max_position: int
    text_init_std: float
    rope_theta: float
    rope_factor: float  # Llama 3 rope scaling ("llama3" rope type)
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_position: int
    vision_hidden: int
    vision_heads: int
    vision_layers: int  # local encoder
    vision_global_layers: int  # gated global encoder
    vision_intermediate: int
    image_size: int  # tile side in pixels
    patch_size: int
    max_num_tiles: int
    # local layers whose outputs join the vision features
    intermediate_layers_indices: tuple[int, ...]
    vision_init_std: float
    gate_std: float  # std of the tanh gates (see GATES)
    dtype: str
    rms_norm_eps: float = 1e-5
    vision_norm_eps: float = 1e-5

    @property
    def vision_output_dim(self) -> int:
        """Width of the vision features: the final hidden state and each intermediate layer's, concatenated."""
        return self.vision_hidden * (1 + len(self.intermediate_layers_indices))


PRESETS: dict[str, MllamaSizes] = {
    # 28 px tiles: 2x2 patches + CLS = 5 positions, which the vision model pads to 8. A small
    # rope_original_max_position puts head dims in all three bands of the llama3 rope scaling.
    "tiny": MllamaSizes(
        text_hidden=80,
        text_layers=5,
        cross_attention_layers=(1, 3),
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=136,
        text_vocab=400,
        vocab_multiple=8,
        max_position=1024,
        text_init_std=0.2,
        rope_theta=500000.0,
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position=64,
        vision_hidden=32,
        vision_heads=2,
        vision_layers=3,
        vision_global_layers=2,
        vision_intermediate=64,
        image_size=28,
        patch_size=14,
        max_num_tiles=4,
        intermediate_layers_indices=(0, 2),
        vision_init_std=0.2,
        gate_std=1.0,
        dtype="float32",
    ),
    # meta-llama/Llama-3.2-11B-Vision(-Instruct): vocab 128256, <|image|> = 128256, 1601 positions per tile
    "llama-3.2-11b-vision": MllamaSizes(
        text_hidden=4096,
        text_layers=40,
        cross_attention_layers=(3, 8, 13, 18, 23, 28, 33, 38),
        text_heads=32,
        text_kv_heads=8,
        text_intermediate=14336,
        text_vocab=128000,
        vocab_multiple=256,
        max_position=131072,
        text_init_std=0.02,
        rope_theta=500000.0,
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_max_position=8192,
        vision_hidden=1280,
        vision_heads=16,
        vision_layers=32,
        vision_global_layers=8,
        vision_intermediate=5120,
        image_size=560,
        patch_size=14,
        max_num_tiles=4,
        intermediate_layers_indices=(3, 7, 15, 23, 30),
        vision_init_std=0.02,
        gate_std=1.0,
        dtype="bfloat16",
    ),
}


def mllama_sizes(preset: str = "tiny", **overrides: object) -> MllamaSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`MllamaSizes`) applied."""
    s = replace_sizes(PRESETS, preset, "mllama", overrides)
    check_divides(s, ("text_heads", "text_hidden"), ("text_kv_heads", "text_heads"))
    if not all(0 <= i < s.text_layers for i in s.cross_attention_layers):
        raise ValueError(
            f"cross_attention_layers {list(s.cross_attention_layers)} must be < text_layers "
            f"{s.text_layers}"
        )
    if not all(0 <= i < s.vision_layers for i in s.intermediate_layers_indices):
        raise ValueError(
            f"intermediate_layers_indices {list(s.intermediate_layers_indices)} must be < "
            f"vision_layers {s.vision_layers}"
        )
    return s


def model_vocab(s: MllamaSizes) -> int:
    """config.text_config.vocab_size: the base vocab plus the named specials, rounded up to ``vocab_multiple``."""
    return round_up(s.text_vocab + max(NAMED_SPECIALS) + 1, s.vocab_multiple)


def special_tokens(s: MllamaSizes) -> list[str]:
    """The tokens after the base vocab, in id order: the special block up to the model vocab, then <|image|>."""
    length = model_vocab(s) - s.text_vocab
    return [*token_block(NAMED_SPECIALS, length, "<|reserved_special_token_{}|>"), IMAGE_TOKEN]


def token_ids(s: MllamaSizes) -> dict[str, int]:
    """Ids of the named special tokens and <|image|> (= the model vocab size)."""
    return named_ids(special_tokens(s), s.text_vocab, "<|reserved")


def supported_aspect_ratios(max_num_tiles: int) -> list[list[int]]:
    """Every tile layout [rows, cols] of at most ``max_num_tiles`` tiles, in the order of HF's default (and of
    MllamaImageProcessor, whose aspect_ratio_ids index this list from 1)."""
    n = max_num_tiles
    return [[w, h] for w in range(1, n + 1) for h in range(1, n + 1) if w * h <= n]


def _config_from_sizes(s: MllamaSizes) -> MllamaConfig:
    from transformers import MllamaConfig, MllamaTextConfig, MllamaVisionConfig

    ids = token_ids(s)
    text = MllamaTextConfig(
        **decoder_kwargs(
            s,
            model_vocab(s),
            ids[BOS],
            [ids[t] for t in STOP_TOKENS],
            ids[PAD],
            cross_attention_layers=list(s.cross_attention_layers),
            hidden_act="silu",
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": s.rope_theta,
                "factor": s.rope_factor,
                "low_freq_factor": s.rope_low_freq_factor,
                "high_freq_factor": s.rope_high_freq_factor,
                "original_max_position_embeddings": s.rope_original_max_position,
            },
            tie_word_embeddings=False,
        )
    )
    vision = MllamaVisionConfig(
        hidden_size=s.vision_hidden,
        attention_heads=s.vision_heads,
        num_hidden_layers=s.vision_layers,
        num_global_layers=s.vision_global_layers,
        intermediate_size=s.vision_intermediate,
        hidden_act="gelu",
        vision_output_dim=s.vision_output_dim,
        image_size=s.image_size,
        patch_size=s.patch_size,
        max_num_tiles=s.max_num_tiles,
        intermediate_layers_indices=list(s.intermediate_layers_indices),
        supported_aspect_ratios=supported_aspect_ratios(s.max_num_tiles),
        norm_eps=s.vision_norm_eps,
        initializer_range=s.vision_init_std,
    )
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_index=ids[IMAGE_TOKEN])
    return finish_config(cfg, "MllamaForConditionalGeneration", s.dtype)


def mllama_config(preset: str = "tiny", **overrides: object) -> MllamaConfig:
    """The ``MllamaConfig`` that :func:`make_mllama_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(mllama_sizes(preset, **overrides))


def checkpoint_key(name: str, layout: str = "hub") -> str:
    """Map a transformers-5 parameter name to the on-disk key.

    "transformers" keeps it: model.vision_model.* / model.language_model.* / model.multi_modal_projector.* /
    lm_head.* (what ``save_pretrained(save_original_format=False)`` writes). "hub" is the published meta-llama
    layout: vision_model.* / language_model.model.* / language_model.lm_head.* / multi_modal_projector.*
    (which transformers 5.24's default ``save_pretrained`` also writes, mapping the names back).
    """
    if layout == "transformers":
        return name
    renames = (
        *HUB_TEXT_NAMES,
        ("model.vision_model.", "vision_model."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )
    return renamed(name, "mllama", renames)


def _param_specs(config: MllamaConfig, s: MllamaSizes) -> list[ParamSpec]:
    """(name, shape, kind, std) for every saved tensor, from a meta-device model (no memory used).

    N(0, gate_std) for the tanh gates (:data:`GATES`), N(0, vision_init_std) for the rest of the vision model,
    N(0, text_init_std) for everything else; norm scales ones, biases zeros.
    """
    from transformers import MllamaForConditionalGeneration

    def std_of(name: str) -> float:
        if name.endswith(GATES):
            return s.gate_std
        return s.vision_init_std if name.startswith("model.vision_model.") else s.text_init_std

    return param_specs(MllamaForConditionalGeneration, config, std_of)


def build_mllama_tokenizer(s: MllamaSizes) -> PreTrainedTokenizerFast:
    """The small BPE with Llama 3's special-token block after ``text_vocab`` base ids and <|image|> after it.

    BOS is <|begin_of_text|> (prepended by the tokenizer, as Llama 3's), EOS <|eot_id|> (as the Instruct
    tokenizer), pad <|finetune_right_pad_id|>. The BPE's own "<unk>", "<s>", "</s>" stay at ids 0-2 unused.
    """
    from tokenizers import processors

    tok = build_bpe_tokenizer(
        special_tokens(s),
        vocab_size=s.text_vocab,
        pad=PAD,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    tok.bos_token, tok.eos_token = BOS, EOS
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    ids, vocab = token_ids(s), model_vocab(s) + 8
    check_roles(tok, ids, vocab, bos=BOS, eos=EOS, pad=PAD, image=IMAGE_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_mllama_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random Llama-3.2-Vision checkpoint (weights, config, tokenizer, MllamaProcessor) into
    ``out_dir`` and return its path.

    ``overrides`` are :class:`MllamaSizes` fields (text_layers, cross_attention_layers, vision_layers,
    image_size, max_num_tiles, dtype, ...). Weights: N(0, std) for matrices and embeddings (vision_init_std
    for the vision model, text_init_std for the text model, projector and head), N(0, gate_std) for every
    tanh gate (HF zero-initialises most: the image would not reach the text model), ones for norm scales,
    zeros for biases; seeded per tensor, so a seed gives byte-identical files. ``layout``: "hub" (the
    meta-llama repos' names) or "transformers" (transformers 5's own), see :func:`checkpoint_key`.
    """
    from transformers import MllamaImageProcessor, MllamaProcessor

    check_layout(layout)
    s = mllama_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = build_mllama_tokenizer(s)
    image_processor = MllamaImageProcessor(
        size={"height": s.image_size, "width": s.image_size},
        max_image_tiles=s.max_num_tiles,
        do_convert_rgb=True,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_pad=True,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )
    processor = MllamaProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE
    )
    specs = _param_specs(config, s)
    specs = _param_specs(config, s)
    key = partial(checkpoint_key, layout=layout)
    return write_checkpoint(out_dir, config, processor, specs, key, seed, max_shard_bytes)


def patches_per_tile(s: MllamaSizes) -> int:
    """Vision positions per tile: the patches plus CLS (the vision model pads them to a multiple of 8 inside)."""
    return (s.image_size // s.patch_size) ** 2 + 1


CHECKPOINT_WRITERS = {"mllama": make_mllama_checkpoint}
TEST_CASES = {"mllama": FamilyCase(bench_input_len=60)}
