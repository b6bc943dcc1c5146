"""Weight quantization at load time: which checkpoint quantization formats we read, and `--quantization fp8 |
int8 | int4 | int4_g128 | w8a8`, which converts a model's decoder linear layers after its weights are loaded: FP8
(e4m3, W8A8), int8 / int4 weight-only with a scale per row (W8A16 / W4A16), group-wise int4 with zero points (RTN,
groups of 128 input columns: the AWQ kernels' layout, W4A16) or int8 weights with int8 per-token activations (W8A8).

Checkpoints: FP8 (ModelOpt, llm-compressor, TensorRT-LLM), AWQ (AutoAWQ GEMM layout), GPTQ (4-bit, "gptq" format,
with or without act-order) and compressed-tensors int-quantized W8A8 (llm-compressor's SmoothQuant / W8A8 recipes);
other layouts are refused by name (checkpoint_scheme).

All cover the language model's decoder layers (attention and MLP projections), as TensorRT-LLM's recipes do:
embeddings, the LM head, the vision tower and the projector keep the model's dtype, and so do the layers a
checkpoint lists in `modules_to_not_convert` / `ignore`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from mmserve.config import QUANTIZATION_METHODS
from mmserve.layers.group_quant_linear import (
    W8A8,
    GroupInt4Spec,
    make_group_int4,
    make_w8a8,
    to_group_int4,
    to_w8a8,
)
from mmserve.layers.linear import LinearBase

_AWQ_VERSIONS_REFUSED = ("gemv", "gemv_fast", "marlin", "exllama", "exllamav2", "ipex")


@dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's quantization_config says we load: `method` "fp8" | "awq" | "gptq" | "w8a8"; group-wise
    int4's group size and act-order; the module names / patterns that stay unquantized (`ignore`; "re:" entries
    are regular expressions, AWQ's `substring` entries match any name containing them)."""

    method: str
    group_size: int = 128
    act_order: bool = False
    ignore: tuple[str, ...] = ()
    substring: bool = False


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"checkpoint quantization_config: {what} is not supported (supported: FP8 with per-tensor or per-channel "
        "weight scales; AWQ 4-bit GEMM layout (version 'gemm'); GPTQ 4-bit with checkpoint_format 'gptq'; "
        "compressed-tensors int-quantized W8A8 with per-channel weights and dynamic per-token activations)"
    )


def checkpoint_scheme(qc: dict | object | None) -> CheckpointQuant | None:
    """The quantization a checkpoint's `quantization_config` (config.json's dict or transformers' object) asks for;
    None if it has none. Raises ValueError naming formats we cannot run (AWQ GEMV / Marlin, GPTQ v2 / Marlin / 8-bit,
    block-wise FP8, ...)."""
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8" and not qc.get("weight_block_size"):
        return CheckpointQuant("fp8")
    if method == "modelopt" and str(qc.get("quant_algo", "")).upper() == "FP8":
        return CheckpointQuant("fp8")
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        if _compressed_tensors_fp8(qc):
            return CheckpointQuant("fp8")
        return _compressed_tensors_w8a8(qc)
    detail = " with block-wise scales" if qc.get("weight_block_size") else ""
    raise _refuse(f"quant_method {method!r}{detail}")


def checkpoint_quantization(qc: dict | object | None) -> str | None:
    """The method ("fp8", "awq", "gptq", "w8a8") of a checkpoint's `quantization_config`; None if it has none.
    ValueError as `checkpoint_scheme`."""
    scheme = checkpoint_scheme(qc)
    return scheme.method if scheme else None


def _awq(qc: dict) -> CheckpointQuant:
    version = str(qc.get("version", "gemm")).lower()
    bits = qc.get("bits", qc.get("w_bit", 4))
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r} (its packing differs from the GEMM layout)")
    if bits != 4:
        raise _refuse(f"AWQ with {bits} bits")
    if not qc.get("zero_point", True):
        raise _refuse("AWQ without zero points (zero_point false)")
    return CheckpointQuant(
        "awq",
        int(qc.get("group_size", qc.get("q_group_size", 128))),
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
        substring=True,
    )


def _gptq(qc: dict) -> CheckpointQuant:
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    bits = qc.get("bits", 4)
    if qc.get("is_marlin_format") or fmt != "gptq":
        raise _refuse(f"GPTQ checkpoint_format {'marlin' if qc.get('is_marlin_format') else fmt!r}")
    if bits != 4:
        raise _refuse(f"GPTQ with {bits} bits")
    return CheckpointQuant(
        "gptq",
        int(qc.get("group_size", 128)),
        act_order=bool(qc.get("desc_act", False)),
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
        substring=True,
    )


def _compressed_tensors_w8a8(qc: dict) -> CheckpointQuant:
    fmt = str(qc.get("format", "")).lower()
    if fmt != "int-quantized":
        raise _refuse(f"compressed-tensors format {fmt!r}")
    for name, g in (qc.get("config_groups") or {"-": {}}).items():
        w, a = g.get("weights") or {}, g.get("input_activations") or {}
        if not (w.get("type") == "int" and w.get("num_bits") == 8 and w.get("symmetric", True)):
            raise _refuse(f"compressed-tensors int-quantized group {name!r} weights {w}")
        if w.get("strategy", "channel") not in ("channel", "tensor"):
            raise _refuse(
                f"compressed-tensors int-quantized weights with strategy {w.get('strategy')!r}"
            )
        if not (a.get("type") == "int" and a.get("num_bits") == 8 and a.get("dynamic") is True):
            raise _refuse(
                f"compressed-tensors int-quantized group {name!r} input_activations {a or None}"
            )
        if a.get("strategy", "token") != "token" or not a.get("symmetric", True):
            raise _refuse(
                "compressed-tensors int-quantized activations other than symmetric per-token"
            )
    return CheckpointQuant("w8a8", ignore=tuple(qc.get("ignore") or ()))


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
    """Convert the loaded model's decoder linear layers in place; returns how many were converted. Layers a
    checkpoint quantized already keep their quantization."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
    layers = [
        m
        for _, m in decoder_linears(model)
        if not (m.is_fp8 or m.is_weight_only or m.quant is not None)
    ]
    for layer in layers:
        if method == "fp8":
            layer.to_fp8()
        elif method == "int4_g128":
            to_group_int4(layer, 128)
        elif method == "w8a8":
            to_w8a8(layer)
        else:
            layer.to_weight_only(8 if method == "int8" else 4)
    return len(layers)


def prepare_checkpoint_quantization(model: nn.Module, scheme: CheckpointQuant | None) -> int:
    """Before loading a group-wise int4 (AWQ / GPTQ) or W8A8 checkpoint: make its decoder linears (those it does
    not list as unquantized) hold the checkpoint's tensors. Returns how many layers were made ready. FP8 layers
    turn FP8 as their tensors arrive (models/weights.py)."""
    if scheme is None or scheme.method == "fp8":
        return 0
    parts = model.lora_packed_modules() if hasattr(model, "lora_packed_modules") else {}
    made = 0
    for name, layer in decoder_linears(model):
        if _ignored(name, parts, scheme):
            continue
        if scheme.method == "w8a8":
            make_w8a8(layer)
        else:
            make_group_int4(
                layer, GroupInt4Spec(scheme.method, scheme.group_size, scheme.act_order)
            )
        made += 1
    return made


def _ignored(name: str, parts: dict, scheme: CheckpointQuant) -> bool:
    """Whether the checkpoint keeps decoder linear `name` unquantized; a fused layer (QKV, gate+up) is matched by its
    checkpoint parts' names and must be kept whole or quantized whole."""
    prefix, _, leaf = name.rpartition(".")
    names = [
        f"{prefix}.{part.strip('.')}" for part, (fused, _) in parts.items() if fused == f".{leaf}."
    ]
    hits = [_matches(n, scheme) for n in names or [name]]
    if any(hits) and not all(hits):
        raise ValueError(
            f"checkpoint quantization_config: {name} fuses {names}, but only some of them are left unquantized"
        )
    return all(hits)


def _matches(name: str, scheme: CheckpointQuant) -> bool:
    """A (language-model-relative) module name against the checkpoint's ignore list; plain entries name the
    checkpoint's modules, whose prefixes differ from ours: compared from their `layers.` on."""
    for pattern in scheme.ignore:
        if pattern.startswith("re:"):
            if re.search(pattern[3:], name) or re.search(pattern[3:], f"language_model.{name}"):
                return True
        elif scheme.substring:
            if pattern in name:
                return True
        else:
            tail = pattern[pattern.find("layers.") :] if "layers." in pattern else pattern
            if name == tail or name.endswith("." + tail):
                return True
    return False


def after_loading(model: nn.Module) -> int:
    """Once every weight is in (and `--quantization` applied): let each decoder linear's quant state prepare what
    it computes from its loaded tensors (group_quant_linear: GPTQ act-order's columns sorted by group). Returns
    how many layers hold such a state."""
    layers = [m for _, m in decoder_linears(model) if m.quant is not None]
    for layer in layers:
        layer.quant.after_loading(layer)
    return len(layers)


def _takes_quantized_rows(linear: LinearBase) -> bool:
    """FP8 layers (their rows are quantized per rank's slice either way) and int8 W8A8 layers of whole rows."""
    if linear.is_fp8:
        return True
    return isinstance(linear.quant, W8A8) and linear.quant.takes_quantized_rows(linear)


def fuse_activation_quantization(model: nn.Module) -> int:
    """Let norms and activations that feed a W8A8 linear hand it their output already quantized (one kernel instead
    of two: e4m3 rows on GPUs with FP8 tensor cores, int8 rows on CUDA; see layers/fp8_linear.QuantizesRows).
    Decoder layers list those pairs in `fp8_activation_pairs()`; under tensor parallelism an int8 layer whose
    input is a row-parallel shard keeps quantizing its own (W8A8.takes_quantized_rows). Returns how many
    producers quantize for their layer."""
    fused = 0
    for module in model.modules():
        for producer, linear in getattr(module, "fp8_activation_pairs", lambda: [])():
            if _takes_quantized_rows(linear):
                producer.quantize_for(linear)
                fused += 1
    return fused
