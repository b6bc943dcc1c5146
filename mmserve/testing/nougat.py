"""Random Nougat (facebook/nougat-base: a ``VisionEncoderDecoderModel`` whose encoder is a Donut Swin transformer --
patch embedding + LayerNorm, shifted-window stages with relative position bias tables and patch merging, no final
LayerNorm -- and whose decoder is an MBart decoder with a cross-attention in every layer, ``MBartForCausalLM``)
checkpoints with a NougatProcessor, written offline.

Presets: "tiny" for CPU tests (72x48 px pages: 9x6 = 54 encoder tokens of width 64), "nougat-base" (real shapes,
config and special token ids, random bf16) for benchmarks.

How a page is read: the NougatImageProcessor crops the page's margin (the bounding box of the pixels darker than
200 after min-max stretching the grayscale), resizes its shorter side to min(height, width) of ``size``, shrinks it
(bicubic) to fit ``size``, pads it to exactly ``size`` with black, centered, and normalizes with the ImageNet
mean/std. The encoder's last stage is the decoder's cross-attention memory (``image_tokens`` x ``text_hidden``; no
projection in between: the Swin output width equals d_model). There is no text prompt: the decoder starts from
``decoder_start_token_id`` = ``<s>`` (0) alone and generates until ``</s>`` (2); HF's generate also forces ``</s>``
as the last token when it reaches ``max_length`` (``forced_eos_token_id``, from the MBart config).

The tokenizer mirrors the real one's id layout: ``<s>``, ``<pad>``, ``</s>``, ``<unk>`` = 0..3, the small BPE from
4, the model vocab exactly the tokenizer's length (50000 in the real model). It is a ``NougatTokenizer`` (the only
tokenizer class in transformers 5; ``NougatTokenizerFast`` is an alias of it) with Nougat's own pipeline (see
:func:`build_nougat_tokenizer`), whose ``<s>`` text ``</s>`` are the processor's ``labels``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmserve.models.donut_swin import relative_position_index
from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    LayerSpec,
    check_divides,
    check_layout,
    check_roles,
    checked_name,
    finish_config,
    layer_kind,
    layer_maker,
    meta_tensors,
    replace_sizes,
    special_ids,
)
from mmserve.testing.tokenizer import relaid_bpe_spec
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import NougatTokenizer, VisionEncoderDecoderConfig

BOS, PAD, EOS, UNK = "<s>", "<pad>", "</s>", "<unk>"
SPECIALS = (BOS, PAD, EOS, UNK)  # ids 0..3, as the real (fairseq-style) layout
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
# Persistent buffers that save_pretrained writes (as int64) next to the weights: one per Swin block
INDEX_SUFFIX = ".attention.self.relative_position_index"


@dataclass(frozen=True)
class NougatSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    image_height: int  # DonutSwinConfig.image_size = [height, width]; the processor's size
    image_width: int
    patch_size: int
    window_size: int
    # stage i has width embed_dim * 2**i; the last one's is the encoder's hidden_size
    embed_dim: int
    depths: tuple[int, ...]
    vision_heads: tuple[int, ...]
    vision_init_std: float  # Swin matrices and the patch embedding
    rel_pos_std: float  # the relative position bias tables (HF inits them to zeros)
    text_hidden: int  # MBart d_model: must equal the Swin output width
    text_layers: int  # decoder_layers
    text_heads: int  # decoder_attention_heads (self- and cross-attention)
    text_ffn: int  # decoder_ffn_dim: fc1 -> gelu -> fc2
    vocab_size: int  # the tokenizer's length: <s> <pad> </s> <unk> + the BPE
    max_position: int  # max_position_embeddings; the learned table has 2 more rows (offset 2)
    text_init_std: float  # decoder matrices, word and position embeddings, lm_head (not tied)
    bias_std: float  # every linear bias
    norm_std: float  # every LayerNorm shift
    dtype: str
    # MBartConfig's encoder_* fields: MBartForCausalLM never reads them, but the config's aliases do:
    # num_hidden_layers -> encoder_layers (12 in facebook/nougat-base, whose decoder has 10 layers), num_attention_heads
    # -> encoder_attention_heads. Kept as the real config has them (12 layers; heads and ffn equal to the decoder's).
    encoder_layers: int = 12
    mlp_ratio: float = 4.0
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"

    @property
    def encoder_hidden(self) -> int:
        return self.embed_dim * 2 ** (len(self.depths) - 1)

    @property
    def stage_grids(self) -> list[tuple[int, int]]:
        """(rows, cols) of tokens in each Swin stage: the patch grid, halved by each patch merging."""
        rows, cols = self.image_height // self.patch_size, self.image_width // self.patch_size
        return [(rows >> i, cols >> i) for i in range(len(self.depths))]

    @property
    def image_tokens(self) -> int:
        """Encoder output tokens per page (the cross-attention memory), row-major over the last stage's grid."""
        rows, cols = self.stage_grids[-1]
        return rows * cols


PRESETS: dict[str, NougatSizes] = {
    # 72x48 px (portrait, like the real 896x672): 18x12 patches, then 9x6 = 54 encoder tokens; window 3 tiles both
    # stages with no padding and shifts in both (as the real model's 7 does); head_dim 16 in the encoder and decoder.
    # vision_init_std 0.05 keeps the Swin output (no final norm; std ~0.7) from swamping the decoder's cross-attention,
    # so greedy decoding depends on the tokens so far and on the page
    "tiny": NougatSizes(
        image_height=72,
        image_width=48,
        patch_size=4,
        window_size=3,
        embed_dim=32,
        depths=(2, 2),
        vision_heads=(2, 4),
        vision_init_std=0.05,
        rel_pos_std=0.5,
        text_hidden=64,
        text_layers=3,
        text_heads=4,
        text_ffn=144,
        vocab_size=400,
        max_position=256,
        text_init_std=0.2,
        bias_std=0.1,
        norm_std=0.1,
        dtype="float32",
    ),
    # facebook/nougat-base (transformers' convert_nougat_to_hf.py: DonutSwinConfig(image_size=[896, 672], patch_size=4,
    # depths=[2, 2, 14, 2], num_heads=[4, 8, 16, 32], window_size=7, embed_dim=128) and MBartConfig's defaults but for
    # decoder_layers=10, max_position_embeddings=4096, vocab_size=50000, scale_embedding, no tied embeddings):
    # 28x21 = 588 encoder tokens of width 1024. The hub's weights are fp32 (the conversion's default); the original
    # nougat code runs in bf16, so random bf16 here.
    "nougat-base": NougatSizes(
        image_height=896,
        image_width=672,
        patch_size=4,
        window_size=7,
        embed_dim=128,
        depths=(2, 2, 14, 2),
        vision_heads=(4, 8, 16, 32),
        vision_init_std=0.02,
        rel_pos_std=0.02,
        text_hidden=1024,
        text_layers=10,
        text_heads=16,
        text_ffn=4096,
        vocab_size=50000,
        max_position=4096,
        text_init_std=0.02,
        bias_std=0.02,
        norm_std=0.02,
        dtype="bfloat16",
    ),
}


def nougat_sizes(preset: str = "tiny", **overrides: object) -> NougatSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`NougatSizes`) applied.

    Checked: every Swin stage's grid is whole (the page a multiple of ``patch_size * 2**(stages - 1)``), tiled by
    whole windows and larger than one window (so no stage pads and every odd block shifts, as in the real model), the
    heads divide their widths, and the Swin output width equals ``text_hidden`` (else VisionEncoderDecoderModel would
    add an ``enc_to_dec_proj`` Linear that the real model does not have).
    """
    s = replace_sizes(PRESETS, preset, "nougat", overrides)
    if len(s.depths) != len(s.vision_heads):
        stages = f"depths {list(s.depths)} and vision_heads {list(s.vision_heads)}"
        raise ValueError(f"{stages} must have one entry per stage")
    scale = s.patch_size * 2 ** (len(s.depths) - 1)
    if s.image_height % scale or s.image_width % scale:
        raise ValueError(
            f"image_height {s.image_height} and image_width {s.image_width} must be multiples of "
            f"patch_size * 2**(stages - 1) = {scale}"
        )
    for i, (rows, cols) in enumerate(s.stage_grids):
        if rows % s.window_size or cols % s.window_size or min(rows, cols) <= s.window_size:
            raise ValueError(
                f"stage {i} grid {rows}x{cols} must be a multiple of window_size {s.window_size} and "
                "larger than one window"
            )
        if (s.embed_dim << i) % s.vision_heads[i]:
            raise ValueError(
                f"vision_heads[{i}] {s.vision_heads[i]} must divide the stage width {s.embed_dim << i}"
            )
    if s.encoder_hidden != s.text_hidden:
        raise ValueError(
            f"text_hidden {s.text_hidden} must equal the Swin output width embed_dim * 2**(stages - 1) = "
            f"{s.encoder_hidden}"
        )
    check_divides(s, ("text_heads", "text_hidden"))
    if s.vocab_size < len(SPECIALS) + 256 + 1:
        raise ValueError(f"vocab_size must be >= {len(SPECIALS) + 257}, got {s.vocab_size}")
    return s


def token_ids(s: NougatSizes | None = None) -> dict[str, int]:
    """Ids by token of <s>, <pad>, </s>, <unk> (the same in every preset)."""
    return {t: i for i, t in enumerate(SPECIALS)}


def _config_from_sizes(s: NougatSizes) -> VisionEncoderDecoderConfig:
    from transformers import DonutSwinConfig, MBartConfig, VisionEncoderDecoderConfig

    ids = token_ids(s)
    encoder = DonutSwinConfig(
        image_size=[s.image_height, s.image_width],
        patch_size=s.patch_size,
        embed_dim=s.embed_dim,
        depths=list(s.depths),
        num_heads=list(s.vision_heads),
        window_size=s.window_size,
        mlp_ratio=s.mlp_ratio,
        hidden_act=s.hidden_act,
        layer_norm_eps=s.layer_norm_eps,
        initializer_range=s.vision_init_std,
    )
    decoder = MBartConfig(
        is_decoder=True,
        is_encoder_decoder=False,
        add_cross_attention=True,
        vocab_size=s.vocab_size,
        max_position_embeddings=s.max_position,
        d_model=s.text_hidden,
        decoder_layers=s.text_layers,
        decoder_attention_heads=s.text_heads,
        decoder_ffn_dim=s.text_ffn,
        encoder_layers=s.encoder_layers,
        encoder_attention_heads=s.text_heads,
        encoder_ffn_dim=s.text_ffn,
        activation_function=s.hidden_act,
        scale_embedding=True,
        add_final_layer_norm=True,
        tie_word_embeddings=False,
        init_std=s.text_init_std,
        bos_token_id=ids[BOS],
        pad_token_id=ids[PAD],
        eos_token_id=ids[EOS],
        forced_eos_token_id=ids[EOS],
        decoder_start_token_id=ids[BOS],
    )
    cfg = VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        encoder,
        decoder,
        decoder_start_token_id=ids[BOS],
        pad_token_id=ids[PAD],
        eos_token_id=ids[EOS],
        tie_word_embeddings=False,
    )
    return finish_config(cfg, "VisionEncoderDecoderModel", s.dtype)


def nougat_config(preset: str = "tiny", **overrides: object) -> VisionEncoderDecoderConfig:
    """The ``VisionEncoderDecoderConfig`` that :func:`make_nougat_checkpoint` writes for this preset (no weights)."""
    return _config_from_sizes(nougat_sizes(preset, **overrides))


def checkpoint_key(name: str, layout: str = "hub") -> str:
    """Map a transformers-5 parameter name to the on-disk key: the same in both layouts.

    VisionEncoderDecoderModel has no checkpoint conversion mapping, so ``save_pretrained`` writes the state-dict
    names with or without ``save_original_format``, which are facebook/nougat-base's: ``encoder.embeddings.*``,
    ``encoder.encoder.layers.<stage>.blocks.<i>.*`` (and ``.downsample.*``), ``decoder.model.decoder.*`` and the
    untied ``decoder.lm_head.weight``. The Swin blocks' ``relative_position_index`` buffers are written too (int64).
    """
    return checked_name(name, "nougat", layout, ("encoder.", "decoder."))


def _param_specs(config: VisionEncoderDecoderConfig, s: NougatSizes) -> list[LayerSpec]:
    """(name, shape, kind) of every saved tensor, from a meta-device model: the kinds of
    :func:`~mmserve.testing.recipe.layer_kind` ("matrix": weights, embeddings, the relative position bias
    tables, the untied lm_head), and "rel_pos_index" for the tables' int64 index buffers."""
    from transformers import VisionEncoderDecoderModel

    return [
        (name, shape, "rel_pos_index" if name.endswith(INDEX_SUFFIX) else layer_kind(name, is_norm))
        for name, shape, is_norm in meta_tensors(VisionEncoderDecoderModel, config)
    ]


def _std(name: str, s: NougatSizes) -> float:
    if name.endswith(".relative_position_bias_table"):
        return s.rel_pos_std
    return s.vision_init_std if name.startswith("encoder.") else s.text_init_std


def _maker(s: NougatSizes, seed: int) -> Callable[[LayerSpec], torch.Tensor]:
    """:func:`~mmserve.testing.recipe.layer_maker`'s tensors, the index buffers as the Swin blocks compute them."""
    make, index = layer_maker(s, _std, seed), relative_position_index(s.window_size)
    return lambda spec: index if spec[2] == "rel_pos_index" else make(spec)


def build_nougat_tokenizer(s: NougatSizes) -> NougatTokenizer:
    """A ``NougatTokenizer`` over the small byte-level BPE in the real id layout: <s>, <pad>, </s>, <unk> = 0..3, the
    BPE's tokens from 4 up to ``vocab_size`` (unreachable fillers pad it).

    NougatTokenizer builds its own pipeline around the vocab and merges (NFKC; digits one by one; runs of one
    punctuation character, brackets and newlines isolated; byte-level) and wraps text as ``<s>`` text ``</s>``
    when asked for special tokens; BPE merges across those splits never apply. Its decode is byte-level, and
    ``skip_special_tokens`` drops the four specials. ``post_process_generation`` (Nougat's markdown clean-up)
    needs the optional ``nltk`` and ``Levenshtein`` packages.
    """
    from transformers import NougatTokenizer

    spec = relaid_bpe_spec(s.vocab_size, SPECIALS)
    merges = [
        tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["model"]["merges"]
    ]
    tok = NougatTokenizer(
        vocab=spec["model"]["vocab"],
        merges=merges,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=s.max_position,
        clean_up_tokenization_spaces=False,
    )
    check_roles(tok, token_ids(s), s.vocab_size, unk=UNK, bos=BOS, eos=EOS, pad=PAD)
    assert len(tok) == s.vocab_size, (len(tok), s.vocab_size)
    return tok


def build_nougat_processor(s: NougatSizes) -> tuple[Any, Any]:
    """(NougatProcessor, its NougatImageProcessor) as facebook/nougat-base's preprocessor_config.json: crop the
    margin, resize (shorter side to min(size)), thumbnail to fit, pad to ``image_height`` x ``image_width``
    (black, centered), rescale and ImageNet-normalize; no long-axis alignment."""
    from transformers import NougatImageProcessor, NougatProcessor

    image_processor = NougatImageProcessor(
        size={"height": s.image_height, "width": s.image_width},
        do_crop_margin=True,
        do_resize=True,
        do_thumbnail=True,
        do_align_long_axis=False,
        do_pad=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
        resample=2,
    )
    processor = NougatProcessor(
        image_processor=image_processor, tokenizer=build_nougat_tokenizer(s)
    )
    return processor, image_processor


def make_nougat_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    **overrides: object,
) -> Path:
    """Write a complete random Nougat checkpoint (weights, config, generation config, NougatTokenizer,
    NougatProcessor) into ``out_dir`` (created if missing) and return its path.

    ``overrides`` are :class:`NougatSizes` fields (text_layers, depths, image_height, dtype, ...). Weights:
    N(0, vision_init_std) for the Swin matrices and patch embedding, N(0, rel_pos_std) for the relative position
    bias tables, N(0, text_init_std) for the decoder's matrices, word and position embeddings and the (untied)
    lm_head, N(0, bias_std) for every linear bias, ones for the LayerNorm scales and N(0, norm_std) for their shifts;
    the relative position index buffers as transformers computes them, in int64. Seeded per tensor, so a seed gives
    byte-identical files. ``layout``: "hub" or "transformers", the same names (see :func:`checkpoint_key`).
    generation_config.json: bos = decoder_start = 0, eos = forced_eos = 2, pad = 1.
    """
    check_layout(layout)
    s = nougat_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    processor, _ = build_nougat_processor(s)
    specs, key = _param_specs(config, s), partial(checkpoint_key, layout=layout)
    eos = config.decoder.eos_token_id
    return write_checkpoint(
        *(out_dir, config, processor, specs, key, seed, max_shard_bytes),
        make_fn=_maker(s, seed),
        # the weights in the model dtype, but the int64 relative-position index buffers save_pretrained writes
        dtype_fn=lambda spec: torch.int64 if spec[2] == "rel_pos_index" else None,
        generation=special_ids(config.decoder, "bos_token_id", "eos_token_id", "pad_token_id")
        | {"decoder_start_token_id": config.decoder_start_token_id, "forced_eos_token_id": eos},
        progress=progress,
    )


CHECKPOINT_WRITERS = {"nougat": make_nougat_checkpoint}
TEST_CASES = {"nougat": FamilyCase(bench_input_len=20)}
