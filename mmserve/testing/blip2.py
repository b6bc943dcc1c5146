"""Random BLIP-2 (ViT + Q-Former + OPT) checkpoints with a Blip2Processor, written offline.

Presets: "tiny" for CPU tests and "blip2-opt-2.7b" (real shapes, random fp16) for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmserve.testing.tokenizer import bpe_token_ids, build_bpe_tokenizer
from mmserve.testing.writer import (
    DEFAULT_MAX_SHARD_BYTES, check_layout, check_token_ids, finish_config, make_tensor, meta_tensors, replace_sizes,
    round_up, write_checkpoint)

if TYPE_CHECKING:
    from transformers import Blip2Config

IMAGE_TOKEN = "<image>"


@dataclass(frozen=True)
class Blip2Sizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_ffn: int
    text_vocab: int  # base BPE vocab; "<pad>" = text_vocab and "<image>" = text_vocab + 1 follow it
    vocab_multiple: int  # model vocab = len(tokenizer) rounded up to this
    max_position: int
    text_init_std: float
    qformer_hidden: int
    qformer_layers: int
    qformer_heads: int
    qformer_intermediate: int
    cross_attention_frequency: int
    num_query_tokens: int
    qformer_init_std: float
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int
    patch_size: int
    vision_init_std: float
    dtype: str
    do_layer_norm_before: bool = True
    norm_noise: float = 0.1  # LayerNorm scales are 1 + N(0, norm_noise), shifts N(0, norm_noise)


PRESETS: dict[str, Blip2Sizes] = {
    "tiny": Blip2Sizes(
        text_hidden=72, text_layers=3, text_heads=4, text_ffn=136, text_vocab=400, vocab_multiple=8,
        max_position=512, text_init_std=0.2,
        qformer_hidden=40, qformer_layers=3, qformer_heads=4, qformer_intermediate=64, cross_attention_frequency=2,
        num_query_tokens=32, qformer_init_std=0.2,
        vision_hidden=48, vision_layers=2, vision_heads=3, vision_intermediate=96, image_size=28, patch_size=14,
        vision_init_std=0.2, dtype="float32",
    ),
    # Salesforce/blip2-opt-2.7b: EVA ViT-g (39 layers), 12-layer Q-Former, OPT-2.7b; image token 50265, vocab 50304
    "blip2-opt-2.7b": Blip2Sizes(
        text_hidden=2560, text_layers=32, text_heads=32, text_ffn=10240, text_vocab=50264, vocab_multiple=64,
        max_position=2048, text_init_std=0.02,
        qformer_hidden=768, qformer_layers=12, qformer_heads=12, qformer_intermediate=3072, cross_attention_frequency=2,
        num_query_tokens=32, qformer_init_std=0.02,
        vision_hidden=1408, vision_layers=39, vision_heads=16, vision_intermediate=6144, image_size=224, patch_size=14,
        vision_init_std=0.02, dtype="float16", norm_noise=0.0,
    ),
}


def blip2_sizes(preset: str = "tiny", **overrides: object) -> Blip2Sizes:
    """The preset's sizes with ``overrides`` (field names of :class:`Blip2Sizes`) applied."""
    return replace_sizes(PRESETS, preset, "blip2", overrides)


def token_ids(s: Blip2Sizes) -> dict[str, int]:
    """unk, bos, eos from the BPE layout; pad right after the base vocab; the processor adds image last."""
    return bpe_token_ids(s.text_vocab, ("pad", "image"))


def _config_from_sizes(s: Blip2Sizes) -> Blip2Config:
    from transformers import Blip2Config, Blip2QFormerConfig, Blip2VisionConfig, OPTConfig

    ids = token_ids(s)
    vocab = round_up(s.text_vocab + 2, s.vocab_multiple)
    text = OPTConfig(
        vocab_size=vocab, hidden_size=s.text_hidden, num_hidden_layers=s.text_layers, ffn_dim=s.text_ffn,
        num_attention_heads=s.text_heads, max_position_embeddings=s.max_position, word_embed_proj_dim=s.text_hidden,
        do_layer_norm_before=s.do_layer_norm_before, activation_function="relu", enable_bias=True,
        init_std=s.text_init_std, tie_word_embeddings=True,
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
    )
    vision = Blip2VisionConfig(
        hidden_size=s.vision_hidden, intermediate_size=s.vision_intermediate, num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads, image_size=s.image_size, patch_size=s.patch_size, hidden_act="gelu",
        layer_norm_eps=1e-6, qkv_bias=True,
    )
    qformer = Blip2QFormerConfig(
        hidden_size=s.qformer_hidden, num_hidden_layers=s.qformer_layers, num_attention_heads=s.qformer_heads,
        intermediate_size=s.qformer_intermediate, cross_attention_frequency=s.cross_attention_frequency,
        encoder_hidden_size=s.vision_hidden, hidden_act="gelu", layer_norm_eps=1e-12,
    )
    cfg = Blip2Config(
        vision_config=vision.to_dict(), qformer_config=qformer.to_dict(), text_config=text.to_dict(),
        num_query_tokens=s.num_query_tokens, image_token_index=ids["image"],
    )
    return finish_config(cfg, "Blip2ForConditionalGeneration", s.dtype)


def blip2_config(preset: str = "tiny", **overrides: object) -> Blip2Config:
    """The ``Blip2Config`` that :func:`make_blip2_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(blip2_sizes(preset, **overrides))


# The Salesforce repos were converted with transformers 4.2x, whose Q-Former layers also held the text
# branch's feed-forward; transformers 5 neither builds nor saves it (nor the tied lm_head).
_TEXT_FFN = (("intermediate.dense.weight", "ffn_in"), ("intermediate.dense.bias", "ffn_mid"),
             ("output.dense.weight", "ffn_out"), ("output.dense.bias", "hid"),
             ("output.LayerNorm.weight", "hid"), ("output.LayerNorm.bias", "hid"))


def _param_specs(config: Blip2Config, s: Blip2Sizes, layout: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(checkpoint name, shape, kind) for every saved tensor, from :func:`~mmserve.testing.writer.meta_tensors`."""
    from transformers import Blip2ForConditionalGeneration

    specs = []
    for name, shape, is_norm in meta_tensors(Blip2ForConditionalGeneration, config):
        if name == "language_model.lm_head.weight":
            continue   # tied to the word embeddings: "hub" adds it back below
        if is_norm:
            kind = "norm_" + name.rsplit(".", 1)[1]
        elif name.endswith("self_attn.qkv.bias"):
            kind = "qv_bias"
        else:
            kind = "normal"
        specs.append((name, shape, kind))
    if layout == "hub":
        specs.append(("language_model.lm_head.weight",
                      (config.text_config.vocab_size, config.text_config.hidden_size), "normal"))
        h, i = s.qformer_hidden, s.qformer_intermediate
        shapes = {"ffn_in": (i, h), "ffn_mid": (i,), "ffn_out": (h, i), "hid": (h,)}
        for layer in range(s.qformer_layers):
            for suffix, shape in _TEXT_FFN:
                kind = "norm_" + suffix.rsplit(".", 1)[1] if "LayerNorm" in suffix else "normal"
                specs.append((f"qformer.encoder.layer.{layer}.{suffix}", shapes[shape], kind))
    return specs


def _std(name: str, s: Blip2Sizes) -> float:
    if name.startswith("vision_model."):
        return s.vision_init_std
    if name.startswith(("qformer.", "query_tokens")):
        return s.qformer_init_std
    return s.text_init_std


def _make(name: str, shape: tuple[int, ...], kind: str, s: Blip2Sizes, seed: int, dtype: torch.dtype) -> torch.Tensor:
    # the tied head repeats the embedding matrix, so both layouts hold the same model
    source = "language_model.model.decoder.embed_tokens.weight" if name == "language_model.lm_head.weight" else name
    if kind.startswith("norm_"):
        noise = make_tensor(source, shape, "normal", s.norm_noise, seed, torch.float32)
        return (noise + (1.0 if kind == "norm_weight" else 0.0)).to(dtype)
    t = make_tensor(source, shape, "normal", _std(source, s), seed, dtype)
    if kind == "qv_bias":   # [q_bias, 0, v_bias]: the ViT has no key bias
        t[shape[0] // 3: 2 * shape[0] // 3] = 0
    return t


def make_blip2_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "transformers",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random BLIP-2 (OPT) checkpoint + Blip2Processor into ``out_dir``; return its path.

    ``overrides`` are :class:`Blip2Sizes` fields. Weights: N(0, std) for matrices, embeddings, biases and
    the query tokens (std per part: vision / Q-Former / text), LayerNorms 1 + noise and noise; seeded per
    tensor by name, so a seed gives byte-identical files, and one tensor is in RAM at a time.
    ``layout``: "transformers" (what transformers 5.23 ``save_pretrained`` writes) or "hub" (as the
    Salesforce repos: plus the tied ``lm_head`` and the Q-Former's unused text feed-forward).
    The processor adds ``<image>`` to the tokenizer itself (a tokenizer already carrying an
    ``image_token`` breaks it), so the model vocab is sized after it is built.
    """
    from transformers import BlipImageProcessor, Blip2Processor

    check_layout(layout)
    s = blip2_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    tok = build_bpe_tokenizer([], vocab_size=s.text_vocab)
    image_processor = BlipImageProcessor(size={"height": s.image_size, "width": s.image_size})
    processor = Blip2Processor(image_processor=image_processor, tokenizer=tok, num_query_tokens=s.num_query_tokens)
    check_token_ids(tok, token_ids(s), {"image": IMAGE_TOKEN}, config.text_config.vocab_size)
    dtype = getattr(torch, s.dtype)
    return write_checkpoint(out_dir, config, processor, image_processor, _param_specs(config, s, layout),
                            lambda name: name, dtype, seed, max_shard_bytes,
                            make_fn=lambda sp: _make(*sp, s, seed, dtype))
