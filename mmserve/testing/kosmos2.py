"""Random Kosmos-2 (microsoft/kosmos-2-patch14-224: a CLIP ViT whose whole output, after its post-LayerNorm and an
L2 normalisation, a latent-query cross-attention resamples to ``latent_query_num`` embeddings, and a Magneto-style
decoder: pre-LayerNorm blocks with an extra LayerNorm inside the attention (``inner_attn_ln``, before out_proj) and
inside the MLP (``ffn_layernorm``, after the gelu), biases everywhere, sinusoidal positions, a scaled and tied word
embedding) checkpoints with a Kosmos2Processor, written offline.

Presets: "tiny" for CPU tests (42 px images: 3x3 patches) and "kosmos-2-patch14-224" (real shapes, config and
special token ids, random fp16, written tensor by tensor) for benchmarks.

How Kosmos2Processor lays out a prompt with one image: ``<s>`` ``<image>``, ``latent_query_num`` placeholder ids,
``</image>``, then the (stripped) text. The placeholders are the ids ``unk + 1`` .. ``unk + latent_query_num``
(4..67: ordinary vocab entries, overwritten by the processor after tokenization), and ``image_embeds_position_mask``
is 1 exactly there. The number of placeholders is the processor's ``num_image_tokens`` (a class attribute, 64, that
processor_config.json cannot change), so every preset keeps ``latent_query_num`` = 64. Without an image: ``<s>`` +
text. The processor never uses the tokenizer's own special tokens (it writes ``<s>`` into the text), unless
``add_eos_token=True``: then the tokenizer's XLM-R template, ``<s>`` text ``</s>``.

The tokenizer mirrors the real (XLM-R) one's id layout: ``<s>``, ``<pad>``, ``</s>``, ``<unk>`` = 0..3, the small
BPE from 4, ``<mask>`` after the base vocab, then the 11 tag tokens (``</doc>``, ``<image>``, ``</image>``,
``</chunk>``, ``</line>``, ``<phrase>``, ``</phrase>``, ``<object>``, ``</object>``,
``</delimiter_of_multi_objects/>``, ``<grounding>``) and the ``<patch_index_XXXX>`` tokens, which
Kosmos2Processor adds itself (non-special, lstrip). The model vocab is exactly the tokenizer's length, as in the real
model (65037). See :func:`build_kosmos2_tokenizer`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    LayerSpec,
    check_divides,
    check_layout,
    check_roles,
    checked_name,
    clip_image_processor,
    finish_config,
    layer_kind,
    layer_maker,
    meta_tensors,
    replace_sizes,
    vit_kwargs,
)
from mmserve.testing.tokenizer import relaid_bpe_spec, templated_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import Kosmos2Config, PreTrainedTokenizerFast

BOS, PAD, EOS, UNK, MASK = "<s>", "<pad>", "</s>", "<unk>", "<mask>"
BASE_SPECIALS = (BOS, PAD, EOS, UNK)  # ids 0..3, as XLM-R's fairseq layout
# Kosmos2Processor.tag_tokens, in the order it adds them (the real ids are 64002..64012)
TAG_TOKENS = (
    "</doc>",
    "<image>",
    "</image>",
    "</chunk>",
    "</line>",
    "<phrase>",
    "</phrase>",
    "<object>",
    "</object>",
    "</delimiter_of_multi_objects/>",
    "<grounding>",
)
BOI, EOI, GROUNDING = "<image>", "</image>", "<grounding>"
# Kosmos2Processor.num_image_tokens: a class attribute that no saved config can change
LATENT_QUERY_NUM = 64

# Kosmos-2 has no chat template on the hub: its prompts are plain text ("<grounding> An image of"), and the processor
# puts the image span in itself. So: the text of every message, one message per line; image parts write nothing,
# and add_generation_prompt adds nothing. <grounding> (for boxes in the answer) is part of the user's text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set content = message['content'] -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


@dataclass(frozen=True)
class Kosmos2Sizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int  # embed_dim
    text_layers: int
    text_heads: int
    text_ffn: int  # ffn_dim: fc1 -> gelu -> ffn_layernorm -> fc2
    text_vocab: int  # base vocab: <s> <pad> </s> <unk> + the BPE; <mask>, tags, patch tokens follow
    # <patch_index_XXXX> tokens (a square: sqrt of it patches per side for bboxes)
    num_patch_index_tokens: int
    max_position: int
    text_init_std: float  # text matrices, the (tied) word embedding, the projection's x_attn
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int
    patch_size: int
    vision_init_std: float  # every vision matrix and embedding (patch, class, position)
    latent_query_std: float  # image_to_text_projection.latent_query (HF inits it N(0, 1))
    dense_std: float  # image_to_text_projection.dense: its input rows have unit L2 norm
    bias_std: float  # every linear bias
    norm_std: float  # LayerNorm shifts; the sub-LayerNorms' scales are 1 + N(0, norm_std)
    dtype: str
    latent_query_num: int = LATENT_QUERY_NUM
    layer_norm_eps: float = 1e-5
    text_act: str = "gelu"
    vision_act: str = "quick_gelu"

    @property
    def vocab_size(self) -> int:
        """config.text_config.vocab_size: the tokenizer's length (base, <mask>, tags, patch index tokens)."""
        return self.text_vocab + 1 + len(TAG_TOKENS) + self.num_patch_index_tokens


PRESETS: dict[str, Kosmos2Sizes] = {
    # 64 patch index tokens (8x8 bbox grid; see kosmos2_sizes on post_process_generation); vocab 476. dense_std 1:
    # the projection's inputs have unit L2 norm, so the image features weigh as much as the latent queries
    "tiny": Kosmos2Sizes(
        text_hidden=64,
        text_layers=3,
        text_heads=4,
        text_ffn=144,
        text_vocab=400,
        num_patch_index_tokens=64,
        max_position=1024,
        text_init_std=0.15,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        vision_intermediate=80,
        image_size=42,
        patch_size=14,
        vision_init_std=0.2,
        latent_query_std=1.0,
        dense_std=1.0,
        bias_std=0.1,
        norm_std=0.1,
        dtype="float32",
    ),
    # microsoft/kosmos-2-patch14-224 (Kosmos2Config's defaults): vocab 65037 = 64001 base + <mask> + 11 tags + 1024
    # patch tokens, <image> = 64003; 1.66B parameters; CLIP ViT-L/14 at 224 px (257 positions)
    "kosmos-2-patch14-224": Kosmos2Sizes(
        text_hidden=2048,
        text_layers=24,
        text_heads=32,
        text_ffn=8192,
        text_vocab=64001,
        num_patch_index_tokens=1024,
        max_position=2048,
        text_init_std=0.02,
        vision_hidden=1024,
        vision_layers=24,
        vision_heads=16,
        vision_intermediate=4096,
        image_size=224,
        patch_size=14,
        vision_init_std=0.02,
        latent_query_std=1.0,
        dense_std=0.02,
        bias_std=0.02,
        norm_std=0.02,
        dtype="float16",
    ),
}


def kosmos2_sizes(preset: str = "tiny", **overrides: object) -> Kosmos2Sizes:
    """The preset's sizes with ``overrides`` (field names of :class:`Kosmos2Sizes`) applied.

    ``num_patch_index_tokens`` must be a square (the processor turns float boxes into patch indices on a
    sqrt(n) x sqrt(n) grid; note that ``post_process_generation`` always assumes the real 32 x 32 grid when it turns
    indices back into coordinates). A ``latent_query_num`` other than 64 needs ``num_image_tokens=`` on every
    processor call.
    """
    s = replace_sizes(PRESETS, preset, "kosmos2", overrides)
    check_divides(s, ("text_heads", "text_hidden"), ("vision_heads", "vision_hidden"))
    if s.text_hidden % 2:
        raise ValueError(f"text_hidden {s.text_hidden} must be even (sinusoidal positions)")
    if math.isqrt(s.num_patch_index_tokens) ** 2 != s.num_patch_index_tokens:
        raise ValueError(f"num_patch_index_tokens {s.num_patch_index_tokens} must be a square")
    if s.image_size % s.patch_size:
        raise ValueError(
            f"image_size {s.image_size} must be a multiple of patch_size {s.patch_size}"
        )
    if s.text_vocab < 4 + 256 + 1:
        raise ValueError(f"text_vocab must be >= 261, got {s.text_vocab}")
    return s


def patch_index_tokens(n: int) -> list[str]:
    """``<patch_index_0000>`` .. as Kosmos2Processor names them."""
    return [f"<patch_index_{i:04d}>" for i in range(n)]


def token_ids(s: Kosmos2Sizes) -> dict[str, int]:
    """Ids by token of <s>, <pad>, </s>, <unk>, <mask>, the tag tokens and the first and last patch index token."""
    ids = {t: i for i, t in enumerate(BASE_SPECIALS)}
    ids[MASK] = s.text_vocab
    ids.update({t: s.text_vocab + 1 + i for i, t in enumerate(TAG_TOKENS)})
    first = s.text_vocab + 1 + len(TAG_TOKENS)
    patches = patch_index_tokens(s.num_patch_index_tokens)
    ids.update({patches[0]: first, patches[-1]: first + len(patches) - 1})
    return ids


def image_placeholder_ids(s: Kosmos2Sizes) -> list[int]:
    """The ids Kosmos2Processor writes between <image> and </image>: unk + 1 .. unk + latent_query_num."""
    first = token_ids(s)[UNK] + 1
    return list(range(first, first + s.latent_query_num))


def _config_from_sizes(s: Kosmos2Sizes) -> Kosmos2Config:
    from transformers import Kosmos2Config, Kosmos2TextConfig, Kosmos2VisionConfig

    ids = token_ids(s)
    text = Kosmos2TextConfig(
        vocab_size=s.vocab_size,
        max_position_embeddings=s.max_position,
        embed_dim=s.text_hidden,
        layers=s.text_layers,
        ffn_dim=s.text_ffn,
        attention_heads=s.text_heads,
        activation_function=s.text_act,
        layer_norm_eps=s.layer_norm_eps,
        init_std=s.text_init_std,
        scale_embedding=True,
        tie_word_embeddings=True,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    vision = Kosmos2VisionConfig(
        **vit_kwargs(s),
        hidden_act=s.vision_act,
        layer_norm_eps=s.layer_norm_eps,
        initializer_range=s.vision_init_std,
    )
    cfg = Kosmos2Config(
        text_config=text,
        vision_config=vision,
        latent_query_num=s.latent_query_num,
        tie_word_embeddings=True,
    )
    return finish_config(cfg, "Kosmos2ForConditionalGeneration", s.dtype)


def kosmos2_config(preset: str = "tiny", **overrides: object) -> Kosmos2Config:
    """The ``Kosmos2Config`` that :func:`make_kosmos2_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(kosmos2_sizes(preset, **overrides))


PREFIXES = ("text_model.model.", "vision_model.model.", "image_to_text_projection.")


def checkpoint_key(name: str, layout: str = "hub") -> str:
    """Map a transformers-5 parameter name to the on-disk key: the same in both layouts.

    Kosmos-2 has no checkpoint conversion mapping in transformers 5, so ``save_pretrained`` writes the state-dict
    names with or without ``save_original_format``, and they are microsoft/kosmos-2-patch14-224's:
    text_model.model.* / vision_model.model.* / image_to_text_projection.*. The tied
    ``text_model.lm_head.weight`` is not written.
    """
    return checked_name(name, "kosmos2", layout, PREFIXES)


def _param_specs(config: Kosmos2Config, s: Kosmos2Sizes) -> list[LayerSpec]:
    """(name, shape, kind) of every saved tensor, from a meta-device model: the kinds of
    :func:`~mmserve.testing.recipe.layer_kind`, the text decoder's inner_attn_ln and ffn_layernorm scales
    "noisy_norm_weight". The tied lm_head is not saved."""
    from transformers import Kosmos2ForConditionalGeneration

    tied, sub_norms = config.tie_word_embeddings, (".inner_attn_ln.", ".ffn_layernorm.")
    return [
        (name, shape, layer_kind(name, is_norm, any(n in name for n in sub_norms)))
        for name, shape, is_norm in meta_tensors(Kosmos2ForConditionalGeneration, config)
        if not (tied and name == "text_model.lm_head.weight")
    ]


def _std(name: str, s: Kosmos2Sizes) -> float:
    if name == "image_to_text_projection.latent_query":
        return s.latent_query_std
    if name == "image_to_text_projection.dense.weight":
        return s.dense_std
    return s.vision_init_std if name.startswith("vision_model.") else s.text_init_std


def _maker(s: Kosmos2Sizes, seed: int) -> Callable[[LayerSpec], torch.Tensor]:
    """:func:`~mmserve.testing.recipe.layer_maker`'s tensors, <pad>'s row of the word embedding zero (as in
    fairseq-trained checkpoints; transformers 5.17 zeroes it on load)."""
    make = layer_maker(s, _std, seed)

    def make_row_zeroed(spec: LayerSpec) -> torch.Tensor:
        t = make(spec)
        if spec[0].endswith("embed_tokens.weight"):
            t[token_ids(s)[PAD]] = 0
        return t

    return make_row_zeroed


def build_kosmos2_tokenizer(s: Kosmos2Sizes) -> PreTrainedTokenizerFast:
    """The small byte-level BPE in XLM-R's id layout: <s>, <pad>, </s>, <unk> = 0..3, the BPE's tokens from 4 up to
    ``text_vocab`` (unreachable fillers pad it), then <mask> = ``text_vocab``.

    Like the real tokenizer it adds ``<s>`` text ``</s>`` (pairs: ``<s> A </s></s> B </s>``) when asked for special
    tokens; Kosmos2Processor does not ask (it writes ``<s>`` into the text) unless ``add_eos_token=True``. The tag
    and patch index tokens are not here: Kosmos2Processor adds them when it is built (see
    :func:`make_kosmos2_checkpoint`), so the saved tokenizer has them after <mask>, as the hub's.
    """
    spec = relaid_bpe_spec(s.text_vocab, BASE_SPECIALS)
    spec["model"]["unk_token"] = UNK
    tok = templated_tokenizer(
        spec,
        (*BASE_SPECIALS, MASK),
        f"{BOS}:0 $A:0 {EOS}:0",
        f"{BOS}:0 $A:0 {EOS}:0 {EOS}:1 $B:1 {EOS}:1",
        (BOS, EOS),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        mask_token=MASK,
    )
    check_roles(tok, token_ids(s), s.vocab_size, unk=UNK, bos=BOS, eos=EOS, pad=PAD, mask=MASK)
    assert len(tok) == s.text_vocab + 1, len(tok)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_kosmos2_processor(s: Kosmos2Sizes) -> tuple[object, object]:
    """(Kosmos2Processor, its CLIPImageProcessor): the tokenizer of :func:`build_kosmos2_tokenizer` with the
    processor's tag and patch index tokens added (checked against :func:`token_ids`), images resized straight to
    ``image_size`` squared (no center crop, as the hub's preprocessor_config.json) and CLIP-normalized."""
    from transformers import Kosmos2Processor

    tok = build_kosmos2_tokenizer(s)
    image_processor = clip_image_processor(s.image_size, center_crop=False)
    processor = Kosmos2Processor(
        image_processor, tok, num_patch_index_tokens=s.num_patch_index_tokens
    )
    processor.chat_template = CHAT_TEMPLATE
    ids = token_ids(s)
    got = {t: tok.convert_tokens_to_ids(t) for t in ids}
    assert got == ids and len(tok) == s.vocab_size, (got, ids, len(tok), s.vocab_size)
    return processor, image_processor


def make_kosmos2_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random Kosmos-2 checkpoint (weights, config, tokenizer, Kosmos2Processor) into ``out_dir``
    and return its path.

    ``overrides`` are :class:`Kosmos2Sizes` fields (text_layers, text_hidden, image_size, num_patch_index_tokens,
    dtype, ...). Weights: N(0, text_init_std) for the text model's matrices, the (tied) word embedding and the
    image-to-text projection's x_attn; N(0, dense_std) for its dense; N(0, vision_init_std) for the vision tower's;
    N(0, latent_query_std) for the latent query; N(0, bias_std) for every linear bias; ones for the LayerNorm scales but 1 + N(0, norm_std)
    for the decoder's inner_attn_ln and ffn_layernorm; N(0, norm_std) for every LayerNorm shift; seeded per
    tensor, so a seed gives byte-identical files. ``layout``: "hub" or "transformers", the same names (see
    :func:`checkpoint_key`).
    """
    check_layout(layout)
    s = kosmos2_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    processor, _ = build_kosmos2_processor(s)
    specs = _param_specs(config, s)
    key = partial(checkpoint_key, layout=layout)
    return write_checkpoint(
        out_dir, config, processor, specs, key, seed, max_shard_bytes, make_fn=_maker(s, seed)
    )


CHECKPOINT_WRITERS = {"kosmos2": make_kosmos2_checkpoint}
TEST_CASES = {"kosmos2": FamilyCase(prompt="<grounding> An image of {}", bench_input_len=20)}
