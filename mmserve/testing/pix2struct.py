"""Random Pix2Struct / DePlot (google/deplot: ``Pix2StructForConditionalGeneration`` in VQA mode, ``is_vqa=True``)
checkpoints with a Pix2StructProcessor, written offline.

Presets: "tiny" for CPU tests (4x4 patches, at most 64 of them, width 64) and "deplot" (google/deplot's real shapes:
pix2struct-base, 282.3M parameters, config and special token ids, random bf16, written tensor by tensor) for
benchmarks.

How an image is read: in VQA mode the Pix2StructImageProcessor renders the text prompt (wrapped at 80 characters,
black on white, 36 px, 5 px padding) as a header, scales the narrower of header and picture to the wider one's width
(aspect kept) and stacks the header above the picture. The result is standardized per image (mean and std over all
its values, std floored at 1/sqrt(values)), resized (bilinear, antialiased) to the largest grid of ``patch_height`` x
``patch_width`` patches that keeps its aspect within ``max_patches``, and each patch flattened (row, column, channel;
the channel fastest) with its 1-based row and column in front: ``flattened_patches`` [images, max_patches, 2 +
patch_height * patch_width * 3], zero rows after the picture's patches (``attention_mask`` 0). The encoder: a Linear
(with bias) of each patch's values plus the row and column embeddings (row 0 is the padding's), pre-RMSNorm layers of
unscaled attention (T5-style, no 1/sqrt(d_kv)) and gated gelu_new MLPs, a final RMSNorm. The decoder is T5-like: the
relative position bias (layer 0's self-attention, shared by every layer), cross-attention to the encoder output
(masked by ``attention_mask``) in every layer, an untied lm_head with no output scaling. The prompt is in the pixels
only: the decoder starts from ``decoder_start_token_id`` = ``<pad>`` (0) alone and stops at ``</s>`` (1).

The header font: transformers downloads Arial.TTF from the hub (``ybelkada/fonts``) unless the image processor gets
``font_bytes`` or ``font_path``, and no call of the processor passes them on (``Pix2StructProcessor`` drops an unknown
``font_bytes=`` with a warning, the image processor's kwargs check rejects it). mmserve draws the header with the image
processor's own ``render_header`` instead (:func:`vqa_inputs`; by default in Pillow's built-in TrueType font, as
``models.pix2struct.builtin_font_bytes``); tests of the stock call put that font into an offline hub cache.
Note also that ``Pix2StructProcessor.__call__`` passes ``max_patches=2048`` (its
class default) unless the call gives one, whatever the saved image processor says; the tiny preset's ``seq_len`` is
the real 4096, so such inputs stay in range too.

The tokenizer mirrors the real (T5-style sentencepiece) one's id layout: ``<pad>``, ``</s>``, ``<unk>`` = 0, 1, 2, the
small byte-level BPE from 3, no BOS, ``</s>`` appended when asked for special tokens, the model vocab exactly the
tokenizer's length (50244 in the real model).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserve.models.pix2struct import builtin_font_bytes
from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    LayerSpec,
    check_layout,
    check_roles,
    checked_name,
    finish_config,
    layer_kind,
    layer_maker,
    meta_tensors,
    replace_sizes,
)
from mmserve.testing.tokenizer import relaid_bpe_spec, templated_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_checkpoint

if TYPE_CHECKING:
    from transformers import BatchFeature, Pix2StructConfig, PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"
SPECIALS = (PAD, EOS, UNK)  # ids 0..2, as the real T5-style layout
DEPLOT_PROMPT = "Generate underlying data table of the figure below:"


@dataclass(frozen=True)
class Pix2StructSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    patch_height: int  # the image processor's patch_size
    patch_width: int
    max_patches: int  # the image processor's (the encoder's input length)
    seq_len: int  # rows of the row and column embedding tables (ids are 1-based: > max_patches)
    hidden: int  # both towers' width: the cross-attention's k/v read the encoder output as is
    vision_layers: int
    vision_heads: int
    vision_d_kv: int  # vision attention width is vision_heads * vision_d_kv
    vision_ffn: int  # gated: wi_0, wi_1 -> wo
    text_layers: int
    text_heads: int  # text_heads * text_d_kv must be hidden (its projections are hidden x hidden)
    text_d_kv: int
    text_ffn: int
    vocab_size: int  # the tokenizer's length: <pad> </s> <unk> + the BPE
    vision_init_std: float  # encoder matrices (patch projection, attention, MLP)
    text_init_std: float  # decoder matrices
    # the untied lm_head (the logits' spread: rms-normed states times it * sqrt(hidden))
    lm_head_std: float
    embed_std: float  # word embeddings, row and column embeddings
    rel_bias_std: float  # the decoder's relative_attention_bias table
    bias_std: float  # the patch projection's bias (the only bias)
    norm_std: float  # RMSNorm scales are 1 + N(0, norm_std)
    dtype: str
    relative_buckets: int = 32
    relative_max_distance: int = 128
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_new"

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch (the vision config's patch_embed_hidden_size); the processor adds 2 ids."""
        return self.patch_height * self.patch_width * 3


PRESETS: dict[str, Pix2StructSizes] = {
    # 4x4 patches (48 values), at most 64 of them; head_dim 16 in both towers. Without q.k scaling, std 0.1 keeps the
    # attention logits O(1); the embeddings at std 1 let a picture's patches and a token's identity both show in the
    # residual stream, so greedy decoding depends on the picture and on the tokens so far
    "tiny": Pix2StructSizes(
        patch_height=4,
        patch_width=4,
        max_patches=64,
        seq_len=4096,
        hidden=64,
        vision_layers=2,
        vision_heads=4,
        vision_d_kv=16,
        vision_ffn=128,
        text_layers=2,
        text_heads=4,
        text_d_kv=16,
        text_ffn=128,
        vocab_size=400,
        vision_init_std=0.1,
        text_init_std=0.1,
        lm_head_std=0.25,
        embed_std=1.0,
        rel_bias_std=0.5,
        bias_std=0.1,
        norm_std=0.1,
        dtype="float32",
    ),
    # google/deplot (transformers' convert_pix2struct_original_pytorch_to_hf.py, base size, is_vqa): the default
    # Pix2StructVisionConfig and Pix2StructTextConfig (width 768, 12 + 12 layers, 12 heads of 64, d_ff 2048,
    # patch_embed_hidden_size 768 = 16 * 16 * 3, seq_len 4096, vocab 50244, 32 buckets up to distance 128, gelu_new)
    # and the processor's 16x16 patches, max_patches 2048. The hub's weights are fp32; random bf16 here.
    "deplot": Pix2StructSizes(
        patch_height=16,
        patch_width=16,
        max_patches=2048,
        seq_len=4096,
        hidden=768,
        vision_layers=12,
        vision_heads=12,
        vision_d_kv=64,
        vision_ffn=2048,
        text_layers=12,
        text_heads=12,
        text_d_kv=64,
        text_ffn=2048,
        vocab_size=50244,
        vision_init_std=0.02,
        text_init_std=0.02,
        lm_head_std=0.05,
        embed_std=0.5,
        rel_bias_std=0.1,
        bias_std=0.02,
        norm_std=0.02,
        dtype="bfloat16",
    ),
}


def pix2struct_sizes(preset: str = "tiny", **overrides: object) -> Pix2StructSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`Pix2StructSizes`) applied.

    Checked: the text heads tile ``hidden`` (Pix2StructTextAttention's projections are hidden x hidden), the row and
    column tables cover ``max_patches`` 1-based ids, and the vocab holds the specials, the 256 bytes and a merge.
    """
    s = replace_sizes(PRESETS, preset, "pix2struct", overrides)
    if s.text_heads * s.text_d_kv != s.hidden:
        raise ValueError(
            f"text_heads * text_d_kv ({s.text_heads} * {s.text_d_kv}) must equal hidden {s.hidden}"
        )
    if s.seq_len <= s.max_patches:
        raise ValueError(
            f"seq_len {s.seq_len} must exceed max_patches {s.max_patches} (row/column ids are 1-based)"
        )
    if s.vocab_size < len(SPECIALS) + 256 + 1:
        raise ValueError(f"vocab_size must be >= {len(SPECIALS) + 257}, got {s.vocab_size}")
    return s


def token_ids(s: Pix2StructSizes | None = None) -> dict[str, int]:
    """Ids by token of <pad>, </s>, <unk> (the same in every preset); <pad> is also the decoder start."""
    return {t: i for i, t in enumerate(SPECIALS)}


def _config_from_sizes(s: Pix2StructSizes) -> Pix2StructConfig:
    from transformers import Pix2StructConfig, Pix2StructTextConfig, Pix2StructVisionConfig

    ids = token_ids(s)
    # is_encoder_decoder: Pix2StructConfig sets it on a text_config it gets as a dict (from config.json), but
    # transformers 5.17 leaves a config object's alone, which would then differ from the saved-and-loaded one
    text = Pix2StructTextConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden,
        d_kv=s.text_d_kv,
        d_ff=s.text_ffn,
        num_layers=s.text_layers,
        num_heads=s.text_heads,
        relative_attention_num_buckets=s.relative_buckets,
        relative_attention_max_distance=s.relative_max_distance,
        layer_norm_epsilon=s.layer_norm_eps,
        dense_act_fn=s.hidden_act,
        decoder_start_token_id=ids[PAD],
        pad_token_id=ids[PAD],
        eos_token_id=ids[EOS],
        tie_word_embeddings=False,
        is_encoder_decoder=True,
    )
    vision = Pix2StructVisionConfig(
        hidden_size=s.hidden,
        patch_embed_hidden_size=s.patch_dim,
        d_ff=s.vision_ffn,
        d_kv=s.vision_d_kv,
        num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads,
        dense_act_fn=s.hidden_act,
        layer_norm_eps=s.layer_norm_eps,
        seq_len=s.seq_len,
        relative_attention_num_buckets=s.relative_buckets,
        relative_attention_max_distance=s.relative_max_distance,
    )
    cfg = Pix2StructConfig(
        text_config=text, vision_config=vision, is_vqa=True, tie_word_embeddings=False
    )
    return finish_config(cfg, "Pix2StructForConditionalGeneration", s.dtype)


def pix2struct_config(preset: str = "tiny", **overrides: object) -> Pix2StructConfig:
    """The ``Pix2StructConfig`` that :func:`make_pix2struct_checkpoint` writes for this preset (no weights)."""
    return _config_from_sizes(pix2struct_sizes(preset, **overrides))


def checkpoint_key(name: str, layout: str = "hub") -> str:
    """Map a transformers-5 parameter name to the on-disk key: the same in both layouts.

    Pix2Struct has no checkpoint conversion mapping, so ``save_pretrained`` writes the state-dict names, which are
    google/deplot's: ``encoder.embeddings.*``, ``encoder.encoder.layer.<i>.*``, ``encoder.layernorm.weight``,
    ``decoder.embed_tokens.weight``, ``decoder.layer.<i>.*``, ``decoder.final_layer_norm.weight`` and the untied
    ``decoder.lm_head.weight``.
    """
    return checked_name(name, "pix2struct", layout, ("encoder.", "decoder."))


def _param_specs(config: Pix2StructConfig) -> list[LayerSpec]:
    """(name, shape, kind) of every saved tensor, from a meta-device model: the kinds of
    :func:`~mmserve.testing.recipe.layer_kind`, the T5-style RMSNorm scales (which meta_tensors does not
    recognize) "noisy_norm_weight"."""
    from transformers import Pix2StructForConditionalGeneration

    specs = []
    for name, shape, _ in meta_tensors(Pix2StructForConditionalGeneration, config):
        rms_norm = len(shape) == 1 and name.endswith("norm.weight")
        specs.append((name, shape, layer_kind(name, rms_norm, noisy_norm=True)))
    return specs


EMBEDDINGS = ("embed_tokens.weight", "row_embedder.weight", "column_embedder.weight")


def _std(name: str, s: Pix2StructSizes) -> float:
    if name == "decoder.lm_head.weight":
        return s.lm_head_std
    if name.endswith(EMBEDDINGS):
        return s.embed_std
    if name.endswith("relative_attention_bias.weight"):
        return s.rel_bias_std
    return s.vision_init_std if name.startswith("encoder.") else s.text_init_std


def build_pix2struct_tokenizer(s: Pix2StructSizes) -> PreTrainedTokenizerFast:
    """The small byte-level BPE in the real id layout: <pad>, </s>, <unk> = 0..2, the BPE's tokens from 3 up to
    ``vocab_size`` (unreachable fillers pad it); no BOS, ``</s>`` appended to a text with special tokens (T5's
    template), padding on the right."""
    tok = templated_tokenizer(
        relaid_bpe_spec(s.vocab_size, SPECIALS),
        SPECIALS,
        f"$A:0 {EOS}:0",
        f"$A:0 {EOS}:0 $B:1 {EOS}:1",
        (EOS,),
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
    )
    check_roles(tok, token_ids(s), s.vocab_size, unk=UNK, eos=EOS, pad=PAD)
    assert len(tok) == s.vocab_size and tok.bos_token_id is None, (len(tok), s.vocab_size)
    return tok


def build_pix2struct_processor(s: Pix2StructSizes) -> tuple[Any, Any]:
    """(Pix2StructProcessor, its Pix2StructImageProcessor) as google/deplot's: VQA (the prompt drawn as a header),
    ``patch_height`` x ``patch_width`` patches, at most ``max_patches``, per-image standardization, RGB."""
    from transformers import Pix2StructImageProcessor, Pix2StructProcessor

    image_processor = Pix2StructImageProcessor(
        is_vqa=True,
        max_patches=s.max_patches,
        patch_size={"height": s.patch_height, "width": s.patch_width},
        do_normalize=True,
        do_convert_rgb=True,
    )
    processor = Pix2StructProcessor(
        image_processor=image_processor, tokenizer=build_pix2struct_tokenizer(s)
    )
    return processor, image_processor


def vqa_inputs(
    processor: Any, images: Any, text: str, *, font_bytes: bytes | None = None
) -> BatchFeature:
    """What mmserve gives a VQA checkpoint for ``images`` (a picture or a list) and ``text``: ``flattened_patches``
    [images, max_patches, 2 + patch values] and ``attention_mask`` [images, max_patches], the header drawn offline in
    ``font_bytes`` (default: Pillow's built-in font) at the saved image processor's ``max_patches``
    (``Pix2StructForConditionalGeneration.call_processor``)."""
    from mmserve.models.pix2struct import Pix2StructForConditionalGeneration

    images = images if isinstance(images, list) else [images]
    font = font_bytes if font_bytes is not None else builtin_font_bytes()
    return Pix2StructForConditionalGeneration.call_processor(
        processor, text, {"images": images, "font_bytes": font}
    )


def make_pix2struct_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "hub",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    **overrides: object,
) -> Path:
    """Write a complete random Pix2Struct / DePlot checkpoint (weights, config, generation config, tokenizer,
    Pix2StructProcessor) into ``out_dir`` (created if missing) and return its path.

    ``overrides`` are :class:`Pix2StructSizes` fields (text_layers, hidden, max_patches, dtype, ...). Weights:
    N(0, vision_init_std) for the encoder's matrices, N(0, text_init_std) for the decoder's, N(0, lm_head_std) for the
    untied lm_head, N(0, embed_std) for the word, row and column embeddings, N(0, rel_bias_std) for the relative
    attention bias, N(0, bias_std) for the patch projection's bias and 1 + N(0, norm_std) for every RMSNorm scale;
    seeded per tensor, so a seed gives byte-identical files. ``layout``: "hub" or "transformers", the same names (see
    :func:`checkpoint_key`). generation_config.json: decoder_start = pad = 0, eos = 1 (no bos), as google/deplot's.
    """
    check_layout(layout)
    s = pix2struct_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    processor, _ = build_pix2struct_processor(s)
    specs = _param_specs(config)
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
        generation={
            "decoder_start_token_id": config.text_config.pad_token_id,
            "eos_token_id": config.text_config.eos_token_id,
            "pad_token_id": config.text_config.pad_token_id,
        },
        progress=progress,
    )


CHECKPOINT_WRITERS = {"pix2struct": make_pix2struct_checkpoint}
TEST_CASES = {"pix2struct": FamilyCase(bench_input_len=20)}
