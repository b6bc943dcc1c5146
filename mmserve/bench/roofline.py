"""Memory-bandwidth roofline of a decode step: bytes of LM weights + KV cache read per step, divided by the
copy bandwidth of this device, measured in the same run with a large device-to-device tensor copy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mmserve.bench.workload import now, sync, torch_dtype


@dataclass(frozen=True)
class LMShape:
    """Sizes of the language model that a decode step reads (the vision tower is not run in decode).

    Llama-style decoders (llava's Llama/Mistral, Qwen2, Qwen2-VL's text model) keep the defaults but for
    Qwen2's q/k/v biases; OPT (BLIP-2) has biases on every linear, a two-matrix ReLU MLP, LayerNorms with a
    shift, and optionally a word-embedding width other than `hidden` (project_in/out, lm_head of that width).
    Persimmon (Fuyu's text model) is OPT-like (biases everywhere, LayerNorms, a two-matrix relu2 MLP) plus
    LayerNorms of q and k over `head_dim` (`qk_layernorm`). Kosmos-2's text model is OPT-like too (a two-matrix gelu
    MLP, a tied lm_head) plus two sub-LayerNorms per layer: over the attention output before o and over the MLP's
    inner width before fc2 (`sub_layer_norm`). MBart (Nougat's decoder, in a vision-encoder-decoder) is OPT-like too (a
    two-matrix gelu MLP, an untied lm_head) plus a LayerNorm over the embeddings (`embed_norm`) and a cross-attention in
    every layer (`cross_attention`). T5 (BLIP-2 Flan-T5's text model) counts its decoder stack only (the encoder runs
    once per request): no biases, RMS norms (3 per layer and a final one), a cross-attention in every layer, a gated
    (wi_0, wi_1, wo) or plain (wi, wo) MLP and the lm_head; its relative-position bias table (buckets x heads, in the
    first layer) is left out as an embedding table (a few rows read per step).
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int
    mlp_matrices: int = 3  # gate/up/down (SwiGLU) or fc1/fc2
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_norm: bool = False  # LayerNorm (scale + shift) instead of RMSNorm (scale)
    final_norm: bool = True
    embed_dim: int | None = (
        None  # word-embedding width when it differs from hidden (OPT-350m style)
    )
    kv_dtype_bytes: int | None = (
        None  # bytes per cached K/V element when the cache is not in the model dtype
    )
    # bytes per decoder-layer matrix element when quantized (fp8, int8: 1; int4: 0.5; their per-row scales left out)
    linear_dtype_bytes: float | None = None
    # Mllama: how many of `layers` are cross-attention layers (q and o over `heads`, q/k norms, two gates, the
    # MLP; no KV cache of their own; their k/v projections run once per image, not per step, and are not
    # counted; the images' cross keys/values they read per step are not modelled)
    cross_layers: int = 0
    qk_norm: bool = False  # a q and a k norm over head_dim per self-attention layer (Persimmon)
    sub_layer_norm: bool = (
        False  # LayerNorms over the attention output and the MLP's inner width (Kosmos-2)
    )
    # every layer also attends to the encoder's output (MBart): its LayerNorm, q and o over `heads` (with the self-
    # attention's biases); its k/v projections of the encoder output run once per image, not per step, and are not
    # counted (nor the cross keys/values it reads per step, as for Mllama's cross layers)
    cross_attention: bool = False
    embed_norm: bool = (
        False  # a LayerNorm over the (scaled) embeddings before the first layer (MBart)
    )
    tp: int = 1  # tensor-parallel ranks: each GPU reads 1/tp of the matrices and KV heads

    @property
    def weight_bytes(self) -> int:
        """Every LM matrix, bias and norm is read once per step; of the embedding tables only B rows (ignored)."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        norm = 2 * h if self.layer_norm else h
        matrices = h * q + 2 * h * kv + q * h + self.mlp_matrices * h * i  # q, k, v, o, MLP
        per_layer = 2 * norm + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        per_layer += (
            ((self.mlp_matrices - 1) * i + h) if self.mlp_bias else 0
        )  # gate/up or fc1, down/fc2
        per_layer += 2 * self.head_dim * (2 if self.layer_norm else 1) if self.qk_norm else 0
        per_layer += 2 * (q + i) if self.sub_layer_norm else 0
        if self.cross_attention:
            matrices += 2 * h * q  # cross q, o
            per_layer += norm + (q if self.qkv_bias else 0) + (h if self.o_bias else 0)
        e = self.embed_dim or h
        head = (
            self.vocab * e + (2 * h * e if e != h else 0) + (norm if self.final_norm else 0)
        )  # lm_head, proj
        head += norm if self.embed_norm else 0
        selfs, cross = self.layers - self.cross_layers, self.cross_layers
        cross_matrices = 2 * h * q + self.mlp_matrices * h * i
        cross_per_layer = 2 * norm + 2 * self.head_dim + 2
        matrix_bytes = int(
            (selfs * matrices + cross * cross_matrices)
            * (self.linear_dtype_bytes or self.dtype_bytes)
        )
        return (
            selfs * per_layer + cross * cross_per_layer + head
        ) * self.dtype_bytes + matrix_bytes // self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        kv_heads = max(
            1, self.kv_heads // self.tp
        )  # per GPU (replicated when fewer heads than ranks)
        return (
            2
            * (self.layers - self.cross_layers)
            * kv_heads
            * self.head_dim
            * (self.kv_dtype_bytes or self.dtype_bytes)
        )


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json: `text_config` (llava*, qwen2_vl, blip2's OPT), the `decoder` of a
    vision-encoder-decoder (Nougat's MBart), else itself."""
    if cfg.get("model_type") == "vision-encoder-decoder":
        return cfg["decoder"]
    return cfg.get("text_config") or cfg


_LINEAR_BYTES = {
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
}  # --quantization -> stored bytes per matrix element


def lm_shape(
    model_dir: str,
    dtype: str,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    tp: int = 1,
) -> LMShape:
    """Read the text model's sizes from a vision-language (or plain decoder) config.json; quantized decoder matrices
    count their stored bytes: one per element for FP8 (`quantization="fp8"`, or a checkpoint quantized to FP8) and
    int8, half a byte for int4. `tp`: the bytes one GPU of that many tensor-parallel ranks reads."""
    import torch

    from mmserve.config import CacheConfig
    from mmserve.models.quantization import checkpoint_quantization

    config = json.loads((Path(model_dir) / "config.json").read_text())
    text = text_config(config)
    if (
        text.get("model_type") == "kosmos_2_text_model"
    ):  # its config.json spells the sizes its own way
        text = {
            **text,
            "hidden_size": text["embed_dim"],
            "num_hidden_layers": text["layers"],
            "num_attention_heads": text["attention_heads"],
            "intermediate_size": text["ffn_dim"],
        }
    if (
        text.get("model_type") == "mbart"
    ):  # the decoder_* sizes (num_hidden_layers etc. alias the encoder's)
        text = {
            **text,
            "hidden_size": text["d_model"],
            "num_hidden_layers": text["decoder_layers"],
            "num_attention_heads": text["decoder_attention_heads"],
            "intermediate_size": text["decoder_ffn_dim"],
        }
    if text.get("model_type") == "t5":  # the decoder stack's sizes (num_layers is the encoder's)
        text = {
            **text,
            "hidden_size": text["d_model"],
            "num_attention_heads": text["num_heads"],
            "head_dim": text["d_kv"],
            "intermediate_size": text["d_ff"],
            "num_hidden_layers": text.get("num_decoder_layers") or text["num_layers"],
        }
    if text.get("model_type") == "pix2struct_text_model":  # T5-style names, its own hidden_size
        text = {
            **text,
            "num_attention_heads": text["num_heads"],
            "head_dim": text["d_kv"],
            "intermediate_size": text["d_ff"],
            "num_hidden_layers": text["num_layers"],
        }
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    model_dtype = torch_dtype(dtype)
    cache_dtype = CacheConfig(kv_cache_dtype=kv_cache_dtype).cache_dtype(model_dtype)
    common = dict(
        hidden=hidden,
        layers=int(text["num_hidden_layers"]),
        heads=heads,
        vocab=int(text["vocab_size"]),
        head_dim=int(text.get("head_dim") or hidden // heads),
        dtype_bytes=torch.finfo(model_dtype).bits // 8,
        kv_dtype_bytes=torch.finfo(cache_dtype).bits // 8,
        linear_dtype_bytes=_LINEAR_BYTES.get(quantization)
        or (1 if checkpoint_quantization(config.get("quantization_config")) == "fp8" else None),
        tp=tp,
    )
    if text.get("model_type") == "opt":
        bias = bool(text.get("enable_bias", True))
        return LMShape(
            **common,
            intermediate=int(text["ffn_dim"]),
            kv_heads=heads,
            mlp_matrices=2,
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bias,
            layer_norm=True,
            final_norm=bool(text.get("do_layer_norm_before", True))
            and not text.get("_remove_final_layer_norm", False),
            embed_dim=int(text.get("word_embed_proj_dim") or hidden),
        )
    if text.get("model_type") == "kosmos_2_text_model":
        return LMShape(
            **common,
            intermediate=int(text["intermediate_size"]),
            kv_heads=heads,
            mlp_matrices=2,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            layer_norm=True,
            sub_layer_norm=True,
        )
    if text.get("model_type") == "mbart":
        return LMShape(
            **common,
            intermediate=int(text["intermediate_size"]),
            kv_heads=heads,
            mlp_matrices=2,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            layer_norm=True,
            embed_norm=True,
            cross_attention=bool(text.get("add_cross_attention", False)),
        )
    if text.get("model_type") == "t5":
        gated = str(text.get("feed_forward_proj", "relu")).startswith("gated-")
        return LMShape(
            **common,
            intermediate=int(text["intermediate_size"]),
            kv_heads=heads,
            mlp_matrices=3 if gated else 2,
            cross_attention=True,
        )
    if text.get("model_type") == "pix2struct_text_model":  # always gated
        return LMShape(
            **common,
            intermediate=int(text["intermediate_size"]),
            kv_heads=heads,
            mlp_matrices=3,
            cross_attention=True,
        )
    if text.get("model_type") in ("persimmon", "fuyu"):  # "fuyu": adept/fuyu-8b's flat config.json
        return LMShape(
            **common,
            intermediate=int(text["intermediate_size"]),
            kv_heads=heads,
            mlp_matrices=2,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            layer_norm=True,
            qk_norm=bool(text.get("qk_layernorm", True)),
        )
    attention_bias = bool(text.get("attention_bias", False))
    return LMShape(
        **common,
        intermediate=int(text["intermediate_size"]),
        kv_heads=int(text.get("num_key_value_heads") or heads),
        qkv_bias=attention_bias or "qwen2" in str(text.get("model_type", "")),
        o_bias=attention_bias,
        mlp_bias=bool(text.get("mlp_bias", False)),
        cross_layers=len(text.get("cross_attention_layers") or ()),
    )


def measure_copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> dict[str, float]:
    """Bytes moved (read + written) per second by `dst.copy_(src)` of `nbytes` on `device`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up (allocation, first-touch pages, clocks)
    sync(device)
    t0 = now()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    elapsed = now() - t0
    del src, dst
    return {
        "copy_bytes": nbytes,
        "iters": iters,
        "seconds": elapsed,
        "bytes_per_s": 2 * nbytes * iters / elapsed,
        "gb_per_s": 2 * nbytes * iters / elapsed / 1e9,
    }


def decode_roofline(
    shape: LMShape, batch_size: int, context_len: float, bytes_per_s: float
) -> dict[str, float]:
    """Best-case decode step when it is bound by memory traffic.

    Args:
        batch_size: sequences decoded together (one token each per step).
        context_len: mean tokens already in each sequence's KV cache during the step.
        bytes_per_s: measured device copy bandwidth.
    Returns:
        bytes_per_step (weights + KV), ms_per_step and tok_s at that bandwidth.
    """
    kv = batch_size * context_len * shape.kv_bytes_per_token
    total = shape.weight_bytes + kv
    seconds = total / bytes_per_s
    return {
        "weight_bytes": shape.weight_bytes,
        "kv_bytes": kv,
        "bytes_per_step": total,
        "ms_per_step": seconds * 1e3,
        "tok_s": batch_size / seconds,
    }


def shape_record(shape: LMShape) -> dict[str, int]:
    return {
        **asdict(shape),
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
    }
