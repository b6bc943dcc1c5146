"""Weight quantization at load time: which checkpoint quantization formats we read, and `--quantization fp8 |
int8 | int4`, which converts a model's decoder linear layers to FP8 (e4m3, W8A8) or int8 / int4 (weight-only,
W8A16 / W4A16) after its weights are loaded.

Both cover the language model's decoder layers (attention and MLP projections), as TensorRT-LLM's FP8 and
weight-only recipes do: embeddings, the LM head, the vision tower and the projector keep the model's dtype.
"""

from __future__ import annotations

from torch import nn

from mmserve.config import QUANTIZATION_METHODS
from mmserve.layers.linear import LinearBase


def checkpoint_quantization(qc: dict | object | None) -> str | None:
    """The method ("fp8") of a checkpoint's `quantization_config` (config.json's dict or transformers'
    object) that we load; None if the checkpoint has none.

    Raises ValueError for formats we cannot run (AWQ, GPTQ, block-wise FP8, ...), naming the method.
    """
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8" and not qc.get("weight_block_size"):
        return "fp8"
    if method == "modelopt" and str(qc.get("quant_algo", "")).upper() == "FP8":
        return "fp8"
    if method == "compressed-tensors" and _compressed_tensors_fp8(qc):
        return "fp8"
    detail = " with block-wise scales" if qc.get("weight_block_size") else ""
    raise ValueError(
        f"checkpoint quantization_config: quant_method {method!r}{detail} is not supported "
        f"(supported: FP8 with per-tensor or per-channel weight scales, as ModelOpt, llm-compressor "
        f"and TensorRT-LLM export it)"
    )


def _compressed_tensors_fp8(qc: dict) -> bool:
    groups = list((qc.get("config_groups") or {}).values())
    return bool(groups) and all(
        (g.get("weights") or {}).get("type") == "float"
        and (g.get("weights") or {}).get("num_bits") == 8
        and (g.get("weights") or {}).get("strategy", "tensor") in ("tensor", "channel")
        for g in groups
    )


def decoder_linears(model: nn.Module) -> list[tuple[str, LinearBase]]:
    """The linear layers inside the language model's decoder layers (what FP8 quantization covers)."""
    lm = getattr(model, "language_model", model)
    return [
        (name, m)
        for name, m in lm.named_modules()
        if isinstance(m, LinearBase) and ".layers." in f".{name}."
    ]


def quantize_model(model: nn.Module, method: str) -> int:
    """Convert the loaded model's decoder linear layers in place; returns how many were converted."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    layers = [m for _, m in decoder_linears(model) if not (m.is_fp8 or m.is_weight_only)]
    for layer in layers:
        layer.to_fp8() if method == "fp8" else layer.to_weight_only(8 if method == "int8" else 4)
    return len(layers)


def fuse_activation_quantization(model: nn.Module) -> int:
    """Let norms and activations that feed an FP8 linear hand it their output already quantized (one kernel
    instead of two on GPUs with FP8 tensor cores; see layers/fp8_linear.QuantizesForFP8). Decoder layers
    list those pairs in `fp8_activation_pairs()`. Returns how many producers quantize for an FP8 layer."""
    fused = 0
    for module in model.modules():
        for producer, linear in getattr(module, "fp8_activation_pairs", lambda: [])():
            if linear.is_fp8:
                producer.quantize_for(linear)
                fused += 1
    return fused
