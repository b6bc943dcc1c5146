"""Random BLIP-2 (ViT + Q-Former + OPT or Flan-T5) checkpoints with a Blip2Processor, written offline.

Presets: "tiny" (OPT), "tiny-t5" (Flan-T5) for CPU tests; "blip2-opt-2.7b" (random fp16), "blip2-flan-t5-xl"
(random bf16; the published repo stores float32) for benchmarks, in real shapes.

The Flan-T5 variant (``text_model="t5"``, as Salesforce/blip2-flan-t5-xl) has an encoder-decoder language model:
the ``num_query_tokens`` projected Q-Former outputs replace the ``<image>`` placeholders that the processor puts in
front of the prompt, and the whole sequence (image tokens, text, ``</s>``) is the T5 *encoder*'s input; the
decoder starts from ``decoder_start_token_id`` = ``<pad>`` (0) and cross-attends to the encoder output. Its
tokenizer is :func:`~mmserve.testing.tokenizer.build_t5_tokenizer`'s (``text_vocab`` pieces, then
``text_extra_ids`` sentinels), then the processor's ``<image>`` (32100 in the real model, whose vocab is 32128).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    LayerSpec,
    check_layout,
    check_token_ids,
    finish_config,
    meta_tensors,
    replace_sizes,
    round_up,
    special_ids,
    vit_kwargs,
)
from mmserve.testing.tokenizer import bpe_token_ids, build_bpe_tokenizer, build_t5_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, make_tensor, noisy, write_checkpoint

if TYPE_CHECKING:
    from transformers import Blip2Config

IMAGE_TOKEN = "<image>"


@dataclasses.dataclass(frozen=True)
class Blip2Sizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_ffn: int
    # OPT: base BPE vocab, "<pad>" = text_vocab and "<image>" = text_vocab + 1 follow it;
    # T5: the spiece vocab with <pad>, </s>, <unk>, then text_extra_ids sentinels, then "<image>"
    text_vocab: int
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
    # the language model: "opt" (OPTForCausalLM) or "t5" (T5ForConditionalGeneration: text_hidden = d_model,
    # text_layers = encoder layers, text_ffn = d_ff, text_heads = num_heads)
    text_model: str = "opt"
    text_decoder_layers: int | None = None  # T5 num_decoder_layers (None: text_layers)
    text_head_dim: int | None = None  # T5 d_kv (None: text_hidden // text_heads)
    relative_buckets: int = 32  # T5 relative_attention_num_buckets
    relative_max_distance: int = 128  # T5 relative_attention_max_distance
    relative_bias_std: float = 0.5  # T5 relative_attention_bias tables are N(0, this)
    lm_head_std: float | None = None  # T5's untied lm_head is N(0, this) (None: text_init_std)
    text_extra_ids: int = 100  # T5 sentinel tokens <extra_id_N> after the spiece vocab


PRESETS: dict[str, Blip2Sizes] = {
    "tiny": Blip2Sizes(
        text_hidden=72,
        text_layers=3,
        text_heads=4,
        text_ffn=136,
        text_vocab=400,
        vocab_multiple=8,
        max_position=512,
        text_init_std=0.2,
        qformer_hidden=40,
        qformer_layers=3,
        qformer_heads=4,
        qformer_intermediate=64,
        cross_attention_frequency=2,
        num_query_tokens=32,
        qformer_init_std=0.2,
        vision_hidden=48,
        vision_layers=2,
        vision_heads=3,
        vision_intermediate=96,
        image_size=28,
        patch_size=14,
        vision_init_std=0.2,
        dtype="float32",
    ),
    # Salesforce/blip2-opt-2.7b: EVA ViT-g (39 layers), 12-layer Q-Former, OPT-2.7b; image token 50265, vocab 50304
    "blip2-opt-2.7b": Blip2Sizes(
        text_hidden=2560,
        text_layers=32,
        text_heads=32,
        text_ffn=10240,
        text_vocab=50264,
        vocab_multiple=64,
        max_position=2048,
        text_init_std=0.02,
        qformer_hidden=768,
        qformer_layers=12,
        qformer_heads=12,
        qformer_intermediate=3072,
        cross_attention_frequency=2,
        num_query_tokens=32,
        qformer_init_std=0.02,
        vision_hidden=1408,
        vision_layers=39,
        vision_heads=16,
        vision_intermediate=6144,
        image_size=224,
        patch_size=14,
        vision_init_std=0.02,
        dtype="float16",
        norm_noise=0.0,
    ),
}
# Flan-T5 (d_model 64, d_kv 16, 2 + 2 layers, gated-gelu, untied lm_head) under the "tiny" ViT and Q-Former.
# T5 does not scale q.k by 1/sqrt(d_kv): std 0.1 keeps the attention logits O(1) (q and k entries ~0.8, their dot
# product over 16 dims ~2.6) next to the N(0, 0.5) relative bias, so both matter; the lm_head's std 0.4 spreads
# the logits (~3.2 over the RMS-normalized decoder output). Flan's 32 buckets / max distance 128: prompts of
# 32 image + ~20 text tokens reach the encoder's logarithmic buckets (distances 8..127), the decoder's first 16
# steps its exact ones.
PRESETS["tiny-t5"] = dataclasses.replace(
    PRESETS["tiny"],
    text_model="t5",
    text_hidden=64,
    text_layers=2,
    text_decoder_layers=2,
    text_heads=4,
    text_head_dim=16,
    text_ffn=128,
    text_init_std=0.1,
    lm_head_std=0.4,
)
# Salesforce/blip2-flan-t5-xl: EVA ViT-g and Q-Former as blip2-opt-2.7b's, google/flan-t5-xl (d_model 2048,
# d_kv 64, 32 heads, d_ff 5120, 24 + 24 layers, gated-gelu, untied lm_head); image token 32100, vocab 32128
PRESETS["blip2-flan-t5-xl"] = dataclasses.replace(
    PRESETS["blip2-opt-2.7b"],
    text_model="t5",
    text_hidden=2048,
    text_layers=24,
    text_decoder_layers=24,
    text_heads=32,
    text_head_dim=64,
    text_ffn=5120,
    text_vocab=32000,
    max_position=512,
    dtype="bfloat16",
)


def blip2_sizes(preset: str = "tiny", **overrides: object) -> Blip2Sizes:
    """The preset's sizes with ``overrides`` (field names of :class:`Blip2Sizes`) applied."""
    return replace_sizes(PRESETS, preset, "blip2", overrides)


def token_ids(s: Blip2Sizes) -> dict[str, int]:
    """OPT: unk, bos, eos from the BPE layout, pad right after the base vocab; T5: pad, eos, unk = 0, 1, 2 (no bos),
    the sentinels after the spiece vocab. The processor adds image last."""
    if s.text_model == "t5":
        return {"pad": 0, "eos": 1, "unk": 2, "image": s.text_vocab + s.text_extra_ids}
    return bpe_token_ids(s.text_vocab, ("pad", "image"))


def _text_config(s: Blip2Sizes, vocab: int) -> object:
    from transformers import OPTConfig, T5Config

    ids = token_ids(s)
    if s.text_model == "opt":
        return OPTConfig(
            vocab_size=vocab,
            hidden_size=s.text_hidden,
            num_hidden_layers=s.text_layers,
            ffn_dim=s.text_ffn,
            num_attention_heads=s.text_heads,
            max_position_embeddings=s.max_position,
            word_embed_proj_dim=s.text_hidden,
            do_layer_norm_before=s.do_layer_norm_before,
            activation_function="relu",
            enable_bias=True,
            init_std=s.text_init_std,
            tie_word_embeddings=True,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["pad"],
        )
    if s.text_model == "t5":
        # transformers 5 forces T5Config.tie_word_embeddings to True (the embed_tokens tables share `shared`) and
        # keeps what tie_word_embeddings=False meant as scale_decoder_outputs=False: no d_model**-0.5 before the
        # lm_head, which is loaded untied since it differs from `shared`
        return T5Config(
            vocab_size=vocab,
            d_model=s.text_hidden,
            d_kv=s.text_head_dim or s.text_hidden // s.text_heads,
            d_ff=s.text_ffn,
            num_layers=s.text_layers,
            num_decoder_layers=s.text_decoder_layers or s.text_layers,
            num_heads=s.text_heads,
            relative_attention_num_buckets=s.relative_buckets,
            relative_attention_max_distance=s.relative_max_distance,
            feed_forward_proj="gated-gelu",
            layer_norm_epsilon=1e-6,
            tie_word_embeddings=False,
            pad_token_id=ids["pad"],
            eos_token_id=ids["eos"],
            decoder_start_token_id=ids["pad"],
        )
    raise ValueError(f"text_model must be 'opt' or 't5', got {s.text_model!r}")


def _config_from_sizes(s: Blip2Sizes) -> Blip2Config:
    from transformers import Blip2Config, Blip2QFormerConfig, Blip2VisionConfig

    ids = token_ids(s)
    vocab = round_up(ids["image"] + 1, s.vocab_multiple)  # the tokenizer's length with <image>
    text = _text_config(s, vocab)
    vision = Blip2VisionConfig(
        **vit_kwargs(s), hidden_act="gelu", layer_norm_eps=1e-6, qkv_bias=True
    )
    qformer = Blip2QFormerConfig(
        hidden_size=s.qformer_hidden,
        num_hidden_layers=s.qformer_layers,
        num_attention_heads=s.qformer_heads,
        intermediate_size=s.qformer_intermediate,
        cross_attention_frequency=s.cross_attention_frequency,
        encoder_hidden_size=s.vision_hidden,
        hidden_act="gelu",
        layer_norm_eps=1e-12,
    )
    cfg = Blip2Config(
        vision_config=vision.to_dict(),
        qformer_config=qformer.to_dict(),
        text_config=text.to_dict(),
        num_query_tokens=s.num_query_tokens,
        image_token_index=ids["image"],
    )
    return finish_config(cfg, "Blip2ForConditionalGeneration", s.dtype)


def blip2_config(preset: str = "tiny", **overrides: object) -> Blip2Config:
    """The ``Blip2Config`` that :func:`make_blip2_checkpoint` writes for this preset (no weights built)."""
    return _config_from_sizes(blip2_sizes(preset, **overrides))


# The Salesforce repos were converted with transformers 4.2x, whose Q-Former layers also held the text
# branch's feed-forward; transformers 5 neither builds nor saves it (nor the tied lm_head).
_TEXT_FFN = (
    ("intermediate.dense.weight", "ffn_in"),
    ("intermediate.dense.bias", "ffn_mid"),
    ("output.dense.weight", "ffn_out"),
    ("output.dense.bias", "hid"),
    ("output.LayerNorm.weight", "hid"),
    ("output.LayerNorm.bias", "hid"),
)
# T5's encoder and decoder embed_tokens are tied to `shared`: neither transformers 5 nor the hub files hold them
_T5_TIED = tuple(f"language_model.{side}.embed_tokens.weight" for side in ("encoder", "decoder"))


def _param_specs(config: Blip2Config, s: Blip2Sizes, layout: str) -> list[LayerSpec]:
    """(checkpoint name, shape, kind) for every saved tensor, from :func:`~mmserve.testing.recipe.meta_tensors`."""
    from transformers import Blip2ForConditionalGeneration

    t5 = s.text_model == "t5"
    specs = []
    for name, shape, is_norm in meta_tensors(Blip2ForConditionalGeneration, config):
        if name in _T5_TIED if t5 else name == "language_model.lm_head.weight":
            continue  # OPT's lm_head is tied to the word embeddings: "hub" adds it back below; T5's is untied
        if is_norm or (
            t5 and name.startswith("language_model.") and name.endswith("layer_norm.weight")
        ):
            kind = "norm_" + name.rsplit(".", 1)[1]  # T5LayerNorm: an RMS norm with a scale only
        elif name.endswith("self_attn.qkv.bias"):
            kind = "qv_bias"
        else:
            kind = "normal"
        specs.append((name, shape, kind))
    if layout == "hub":
        if not t5:
            head = (config.text_config.vocab_size, config.text_config.hidden_size)
            specs.append(("language_model.lm_head.weight", head, "normal"))
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
    if name.endswith(".relative_attention_bias.weight"):
        return s.relative_bias_std
    if name == "language_model.lm_head.weight" and s.lm_head_std is not None:
        return s.lm_head_std
    return s.text_init_std


def _maker(s: Blip2Sizes, seed: int) -> Callable[[LayerSpec], torch.Tensor]:
    """The tensor maker of :func:`_param_specs`' specs, in the dtype of ``s``."""
    dtype = getattr(torch, s.dtype)

    def make(spec: LayerSpec) -> torch.Tensor:
        name, shape, kind = spec
        # OPT's tied head repeats the embedding matrix, so both layouts hold the same model; T5's is its own
        tied_head = s.text_model == "opt" and name == "language_model.lm_head.weight"
        source = "language_model.model.decoder.embed_tokens.weight" if tied_head else name
        if kind.startswith("norm_"):
            base = 1.0 if kind == "norm_weight" else 0.0
            return noisy(source, shape, base, s.norm_noise, seed, dtype)
        t = make_tensor(source, shape, "normal", _std(source, s), seed, dtype)
        if kind == "qv_bias":  # [q_bias, 0, v_bias]: the ViT has no key bias
            t[shape[0] // 3 : 2 * shape[0] // 3] = 0
        return t

    return make


def make_blip2_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    layout: str = "transformers",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random BLIP-2 (OPT or Flan-T5) checkpoint + Blip2Processor into ``out_dir``; return its path.

    ``overrides`` are :class:`Blip2Sizes` fields. Weights: N(0, std) for matrices, embeddings, biases and
    the query tokens (std per part: vision / Q-Former / text; T5's relative_attention_bias tables
    ``relative_bias_std``, its lm_head ``lm_head_std``), LayerNorms (T5's RMS norms too) 1 + noise and noise;
    seeded per tensor by name, so a seed gives byte-identical files, and one tensor is in RAM at a time.
    ``layout``: "transformers" (what transformers 5.23 ``save_pretrained`` writes) or "hub" (as the
    Salesforce repos: plus the tied ``lm_head`` (OPT) and the Q-Former's unused text feed-forward; for T5 the
    text_config also says ``tie_word_embeddings: false`` with no ``scale_decoder_outputs``, as transformers 4
    wrote it, where transformers 5 writes ``tie_word_embeddings: true, scale_decoder_outputs: false``; both
    mean an untied lm_head and no ``d_model**-0.5`` scaling before it). T5 in either layout: ``shared`` and
    ``lm_head``, no ``encoder.embed_tokens`` / ``decoder.embed_tokens`` (tied to ``shared``).
    The processor adds ``<image>`` to the tokenizer itself (a tokenizer already carrying an
    ``image_token`` breaks it), so the model vocab is sized after it is built.
    """
    from transformers import Blip2Processor, BlipImageProcessor

    check_layout(layout)
    s = blip2_sizes(preset, **overrides)
    config = _config_from_sizes(s)
    t5 = s.text_model == "t5"
    if t5:
        tok = build_t5_tokenizer(s.text_vocab, s.text_extra_ids)
    else:
        tok = build_bpe_tokenizer([], vocab_size=s.text_vocab)
    size = {"height": s.image_size, "width": s.image_size}
    processor = Blip2Processor(BlipImageProcessor(size=size), tok, s.num_query_tokens)
    check_token_ids(tok, token_ids(s), {"image": IMAGE_TOKEN}, config.text_config.vocab_size)
    specs, make = _param_specs(config, s, layout), _maker(s, seed)
    # T5: the decoder starts from <pad>, no bos
    names = ("decoder_start_token_id", "eos_token_id", "pad_token_id")
    generation = special_ids(config.text_config, *names) if t5 else None
    ckpt = (out_dir, config, processor, specs, lambda n: n, seed, max_shard_bytes)
    out = write_checkpoint(*ckpt, make_fn=make, generation=generation)
    if t5 and layout == "hub":
        path = out / "config.json"
        cfg = json.loads(path.read_text())
        cfg["text_config"]["tie_word_embeddings"] = False
        cfg["text_config"].pop("scale_decoder_outputs", None)
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


CHECKPOINT_WRITERS = {"blip2": make_blip2_checkpoint}
TEST_CASES = {"blip2": FamilyCase(prompt="Question: what is {}? Answer:", bench_input_len=20)}
