"""Random Fuyu (adept/fuyu-8b: a Persimmon decoder whose image input is a linear embedding of raw 30x30 pixel
patches, ``vision_embed_tokens``; no vision encoder) checkpoints with a FuyuProcessor, written offline.

Presets: "tiny" for CPU tests (a 60x90 px image canvas: at most 2 rows of 3 patches) and "fuyu-8b" (real shapes,
config and the known special token ids, random bf16, written tensor by tensor) for benchmarks.

How FuyuProcessor lays out a prompt with one image (the prompt text itself holds no placeholder): the image, as
rows of ``|SPEAKER|`` (one per patch) each ended by ``|NEWLINE|``, then ``<s>`` (BOS), the text, then ``<0x04>``
(beginning of answer). Only ``|SPEAKER|`` positions take patch embeddings; ``|NEWLINE|`` is an ordinary token.
A prompt without an image is the tokenizer's own: ``<s>`` + text, no ``<0x04>``.

The tokenizer: the small BPE (``<unk>``, ``<s>``, ``</s>`` = 0, 1, 2; ``</s>`` unused), then a block of Fuyu's
tokens after the base vocab: ``|SPEAKER|``, ``|NEWLINE|``, ``|ENDOFTEXT|`` (EOS) and the byte tokens
``<0x00>``..``<0x04>`` (box / point delimiters and beginning-of-answer). Like the real SentencePiece-converted
tokenizer (and as FuyuProcessor relies on) every text span gets a leading space ("hello" -> "Ġhello"), and the
control characters ``\\x00``..``\\x04`` in text also become the byte tokens. The pad id is 0: FuyuProcessor sets
``tokenizer.pad_token_id = 0`` whatever the tokenizer says. See :func:`build_fuyu_tokenizer`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    HUB_TEXT_NAMES,
    LayerSpec,
    check_divides,
    check_layout,
    check_roles,
    finish_config,
    layer_kind,
    layer_maker,
    meta_tensors,
    renamed,
    replace_sizes,
)
from mmserve.testing.tokenizer import build_bpe_tokenizer, named_ids, token_block
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import FuyuConfig, PreTrainedTokenizerFast

IMAGE_TOKEN, NEWLINE_TOKEN, EOS = "|SPEAKER|", "|NEWLINE|", "|ENDOFTEXT|"
BOS, PAD = "<s>", "<unk>"
# bbox open/close, point open/close, beginning of answer
BYTE_TOKENS = tuple(f"<0x0{i}>" for i in range(5))
BOA = BYTE_TOKENS[4]
# the split of tokenizers' ByteLevel pre-tokenizer (GPT-2's), which the small BPE was trained with
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Fuyu's token block by offset from the base vocab. "compact" (tiny): right after it. "fuyu-8b": the ids of the
# real tokenizer after 71011 base ids: |SPEAKER| 71011, |NEWLINE| 71019 and <0x04> 71122 as transformers' Fuyu
# processor tests expect; |ENDOFTEXT| 71013 and <0x00>..<0x03> 71118..71121 (consecutive with <0x04>) are
# assumed, not checked against the hub. The other offsets hold "|RESERVED_<i>|" tokens.
TOKEN_LAYOUTS: dict[str, dict[int, str]] = {
    "compact": {
        0: IMAGE_TOKEN,
        1: NEWLINE_TOKEN,
        2: EOS,
        **{3 + i: t for i, t in enumerate(BYTE_TOKENS)},
    },
    "fuyu-8b": {
        0: IMAGE_TOKEN,
        2: EOS,
        8: NEWLINE_TOKEN,
        **{107 + i: t for i, t in enumerate(BYTE_TOKENS)},
    },
}

# Fuyu has no chat template on the hub and its prompts are plain text ("Generate a coco-style caption.\n"); the
# processor puts the image in itself. So: the text of every message, each followed by a newline; image parts
# write nothing, and add_generation_prompt adds nothing (the processor appends <0x04> to image prompts).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
)


@dataclass(frozen=True)
class FuyuSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    text_heads: int  # Persimmon: no GQA, head_dim = text_hidden // text_heads
    text_intermediate: int  # relu2 MLP: dense_h_to_4h, dense_4h_to_h
    text_vocab: int  # base BPE vocab; the block of TOKEN_LAYOUTS[token_layout] follows it
    vocab_size: int  # model vocab (embed_tokens / lm_head rows), >= the tokenizer
    token_layout: str  # a key of TOKEN_LAYOUTS
    max_position: int
    rope_theta: float
    # rotary on the first head_dim * factor dims of each head (NeoX-style halves)
    partial_rotary_factor: float
    text_init_std: float  # matrices and embeddings of the text model and lm_head
    vision_init_std: float  # vision_embed_tokens (patch_size**2 * 3 -> text_hidden)
    bias_std: float  # every linear bias
    norm_std: float  # LayerNorm shifts; q/k LayerNorm scales are 1 + N(0, norm_std)
    patch_size: int
    image_size: int  # config.image_size (unused by the model)
    image_height: int  # image processor canvas: larger images are shrunk to fit, all are padded
    image_width: int
    dtype: str
    hidden_act: str = "relu2"
    layer_norm_eps: float = 1e-5
    qk_layernorm: bool = True


PRESETS: dict[str, FuyuSizes] = {
    # head_dim 20: 10 rotary dims per head (5 frequencies), 10 pass-through
    "tiny": FuyuSizes(
        text_hidden=80,
        text_layers=3,
        text_heads=4,
        text_intermediate=192,
        text_vocab=400,
        vocab_size=408,
        token_layout="compact",
        max_position=1024,
        rope_theta=25000.0,
        partial_rotary_factor=0.5,
        text_init_std=0.15,
        vision_init_std=0.02,
        bias_std=0.1,
        norm_std=0.1,
        patch_size=30,
        image_size=90,
        image_height=60,
        image_width=90,
        dtype="float32",
    ),
    # adept/fuyu-8b (FuyuConfig's defaults): 9.41B parameters, vocab 262144, |SPEAKER| = 71011
    "fuyu-8b": FuyuSizes(
        text_hidden=4096,
        text_layers=36,
        text_heads=64,
        text_intermediate=16384,
        text_vocab=71011,
        vocab_size=262144,
        token_layout="fuyu-8b",
        max_position=16384,
        rope_theta=25000.0,
        partial_rotary_factor=0.5,
        text_init_std=0.02,
        vision_init_std=0.02,
        bias_std=0.02,
        norm_std=0.02,
        patch_size=30,
        image_size=300,
        image_height=1080,
        image_width=1920,
        dtype="bfloat16",
    ),
}


def fuyu_sizes(preset: str = "tiny", **overrides: object) -> FuyuSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`FuyuSizes`) applied."""
    s = replace_sizes(PRESETS, preset, "fuyu", overrides)
    check_divides(s, ("text_heads", "text_hidden"))
    if s.token_layout not in TOKEN_LAYOUTS:
        raise ValueError(
            f"token_layout must be one of {sorted(TOKEN_LAYOUTS)}, got {s.token_layout!r}"
        )
    if s.image_height % s.patch_size or s.image_width % s.patch_size:
        raise ValueError(
            f"image_height {s.image_height} and image_width {s.image_width} must be multiples of "
            f"patch_size {s.patch_size}"
        )
    if len(special_tokens(s)) + s.text_vocab > s.vocab_size:
        raise ValueError(
            f"vocab_size {s.vocab_size} is smaller than the tokenizer "
            f"({s.text_vocab + len(special_tokens(s))})"
        )
    return s


def special_tokens(s: FuyuSizes) -> list[str]:
    """The tokens after the base vocab in id order: the layout's named tokens, "|RESERVED_<i>|" in the gaps."""
    layout = TOKEN_LAYOUTS[s.token_layout]
    return token_block(layout, max(layout) + 1, "|RESERVED_{}|")


def token_ids(s: FuyuSizes) -> dict[str, int]:
    """Ids by token of <unk> (= pad), <s> and Fuyu's named tokens."""
    return {"<unk>": 0, BOS: 1, **named_ids(special_tokens(s), s.text_vocab, "|RESERVED_")}


def image_grid(s: FuyuSizes, width: int, height: int) -> tuple[int, int]:
    """(rows, cols) of patches an image of ``width`` x ``height`` px becomes: shrunk (never enlarged) to fit the
    canvas keeping its aspect ratio (int() of the scaled sides), then each side rounded up to whole patches. The
    prompt gets rows * (cols + 1) image tokens: cols |SPEAKER| and one |NEWLINE| per row."""
    if width > s.image_width or height > s.image_height:
        scale = min(s.image_height / height, s.image_width / width)
        width, height = int(width * scale), int(height * scale)
    return -(-height // s.patch_size), -(-width // s.patch_size)


def _config_from_sizes(s: FuyuSizes) -> FuyuConfig:
    from transformers import FuyuConfig, PersimmonConfig

    ids = token_ids(s)
    text = PersimmonConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.text_hidden,
        intermediate_size=s.text_intermediate,
        num_hidden_layers=s.text_layers,
        num_attention_heads=s.text_heads,
        hidden_act=s.hidden_act,
        max_position_embeddings=s.max_position,
        initializer_range=s.text_init_std,
        layer_norm_eps=s.layer_norm_eps,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": s.rope_theta,
            "partial_rotary_factor": s.partial_rotary_factor,
        },
        qk_layernorm=s.qk_layernorm,
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    cfg = FuyuConfig(
        text_config=text,
        hidden_size=s.text_hidden,
        image_size=s.image_size,
        patch_size=s.patch_size,
        num_channels=3,
        initializer_range=s.text_init_std,
        image_token_id=ids[IMAGE_TOKEN],
        tie_word_embeddings=False,
    )
    return finish_config(cfg, "FuyuForCausalLM", s.dtype)


def fuyu_config(preset: str = "tiny", **overrides: object) -> FuyuConfig:
    """The ``FuyuConfig`` that :func:`make_fuyu_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(fuyu_sizes(preset, **overrides))


def checkpoint_key(name: str, layout: str = "hub") -> str:
    """Map a transformers-5 parameter name to the on-disk key.

    "transformers" keeps it: model.language_model.* / model.vision_embed_tokens.* / lm_head.weight (what
    ``save_pretrained(save_original_format=False)`` writes). "hub" is adept/fuyu-8b's layout (which transformers
    5.24's default ``save_pretrained`` also writes): language_model.model.* / language_model.lm_head.weight /
    vision_embed_tokens.*.
    """
    if layout == "transformers":
        return name
    renames = (*HUB_TEXT_NAMES, ("model.vision_embed_tokens.", "vision_embed_tokens."))
    return renamed(name, "fuyu", renames)


def _param_specs(config: FuyuConfig, s: FuyuSizes) -> list[LayerSpec]:
    """(name, shape, kind) of every saved tensor, from a meta-device model: the kinds of
    :func:`~mmserve.testing.recipe.layer_kind`, the q/k LayerNorms' scales "noisy_norm_weight"."""
    from transformers import FuyuForCausalLM

    return [
        (name, shape, layer_kind(name, is_norm, "q_layernorm" in name or "k_layernorm" in name))
        for name, shape, is_norm in meta_tensors(FuyuForCausalLM, config)
    ]


def _std(name: str, s: FuyuSizes) -> float:
    return s.vision_init_std if "vision_embed_tokens" in name else s.text_init_std


def build_fuyu_tokenizer(s: FuyuSizes) -> PreTrainedTokenizerFast:
    """The small BPE with Fuyu's token block (:data:`TOKEN_LAYOUTS`) after ``text_vocab`` base ids, tokenizing the
    way FuyuProcessor expects of the real (SentencePiece-converted) tokenizer.

    FuyuProcessor tokenizes the image's ``|SPEAKER|``/``|NEWLINE|`` rows + ``<s>`` on their own and drops the
    first id, the "▁" that SentencePiece puts before any text. So, like it: every text span is normalized with a
    leading space (" hello" -> "Ġhello"), and ``|SPEAKER|``/``|NEWLINE|`` are ordinary vocab entries (not added
    tokens, which would be split off before that space), kept whole by the pre-tokenizer and matched whole by the
    BPE (``ignore_merges``). ``|ENDOFTEXT|``, the byte tokens and the reserved ones are added special tokens. The
    characters \\x00..\\x04 in text become the byte tokens <0x00>..<0x04> (a normalizer rewrites them), as the
    real tokenizer's byte fallback does. BOS <s> (prepended), EOS |ENDOFTEXT|, pad <unk> (id 0, what
    FuyuProcessor forces); the BPE's own "</s>" (id 2) stays unused.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    block = special_tokens(s)
    spec = json.loads(
        build_bpe_tokenizer([], vocab_size=s.text_vocab, pad=PAD).backend_tokenizer.to_str()
    )
    vocab: dict[str, int] = spec["model"]["vocab"]
    assert len(vocab) == s.text_vocab, (len(vocab), s.text_vocab)
    vocab.update({t: s.text_vocab + i for i, t in enumerate(block)})
    spec["model"]["ignore_merges"] = True
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.normalizer = normalizers.Sequence(
        [
            normalizers.Prepend(" "),
            *(normalizers.Replace(chr(i), t) for i, t in enumerate(BYTE_TOKENS)),
        ]
    )
    whole = "|".join(re.escape(t) for t in (IMAGE_TOKEN, NEWLINE_TOKEN, *BYTE_TOKENS))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(whole), behavior="isolated"),
            pre_tokenizers.Split(Regex(f"{whole}|{GPT2_SPLIT}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in block
            if t not in (IMAGE_TOKEN, NEWLINE_TOKEN)
        ]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token="<unk>",
        extra_special_tokens=list(BYTE_TOKENS),
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    roles = dict(image=IMAGE_TOKEN, newline=NEWLINE_TOKEN, boa=BOA)
    check_roles(tok, token_ids(s), s.vocab_size, bos=BOS, eos=EOS, pad=PAD, **roles)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_fuyu_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random Fuyu checkpoint (weights, config, tokenizer, FuyuProcessor) into ``out_dir`` and
    return its path.

    ``overrides`` are :class:`FuyuSizes` fields (text_layers, text_hidden, image_height, image_width, dtype, ...).
    Weights: N(0, text_init_std) for the text model's matrices, embeddings and lm_head, N(0, vision_init_std) for
    vision_embed_tokens, N(0, bias_std) for every linear bias (Persimmon has them all), ones for the LayerNorm
    scales but 1 + N(0, norm_std) for the q/k LayerNorms', N(0, norm_std) for every LayerNorm shift; seeded per
    tensor, so a seed gives byte-identical files. ``layout``: "hub" (adept/fuyu-8b's names) or "transformers"
    (transformers 5's own), see :func:`checkpoint_key`.
    """
    from transformers import FuyuImageProcessor, FuyuProcessor

    check_layout(layout)
    s = fuyu_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = build_fuyu_tokenizer(s)
    image_processor = FuyuImageProcessor(
        size={"height": s.image_height, "width": s.image_width},
        patch_size={"height": s.patch_size, "width": s.patch_size},
        do_resize=True,
        do_pad=True,
        padding_value=1.0,
        padding_mode="constant",
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=0.5,
        image_std=0.5,
    )
    processor = FuyuProcessor(image_processor=image_processor, tokenizer=tok)
    processor.chat_template = CHAT_TEMPLATE  # FuyuProcessor.__init__ drops a chat_template argument
    specs = _param_specs(config, s)
    key = partial(checkpoint_key, layout=layout)
    return write_checkpoint(
        out_dir,
        config,
        processor,
        specs,
        key,
        seed,
        max_shard_bytes,
        make_fn=layer_maker(s, _std, seed),
    )


CHECKPOINT_WRITERS = {"fuyu": make_fuyu_checkpoint}
TEST_CASES = {
    "fuyu": FamilyCase(prompt="What is number {} here?", image_size=(40, 30), bench_input_len=20)
}
