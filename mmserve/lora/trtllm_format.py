"""LoRA adapters sent the TensorRT-LLM way: Triton's `lora_weights` and `lora_config` tensors.

`lora_config` [rows, 3] names each row of `lora_weights` [rows, width]: (module id, decoder layer, adapter size
D). A row holds the module's A ("in" weights, [D, in features]) then its B ("out" weights, [out features, D]),
each flattened row-major, then padding up to the widest row; the adapter's scaling (alpha / r) is already in
B, as TensorRT-LLM's `hf_lora_convert.py` writes it. Module ids are TensorRT-LLM's (docs/source/advanced/lora.md):
0 fused qkv, 1 q, 2 k, 3 v, 4 attention output, 5 `mlp_h_to_4h` (a gated MLP's gate_proj, else fc1),
6 `mlp_4h_to_h` (down_proj / fc2), 7 `mlp_gate` (up_proj); the cross-attention (8-12) and MoE (13-16) ids
are refused here.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import nn

from mmserve.lora.adapter import LoRAAdapter, LoRATarget

# module id -> (TensorRT-LLM name, [(our module under the decoder layer, packed shard or None), ...] tried in order)
MODULES: dict[int, tuple[str, list[tuple[str, object]]]] = {
    0: ("attn_qkv", [("self_attn.qkv_proj", None)]),
    1: ("attn_q", [("self_attn.qkv_proj", "q")]),
    2: ("attn_k", [("self_attn.qkv_proj", "k")]),
    3: ("attn_v", [("self_attn.qkv_proj", "v")]),
    4: (
        "attn_dense",
        [("self_attn.o_proj", None), ("self_attn.out_proj", None), ("self_attn.dense", None)],
    ),
    5: ("mlp_h_to_4h", [("mlp.gate_up_proj", 0), ("fc1", None), ("mlp.fc1", None)]),
    6: ("mlp_4h_to_h", [("mlp.down_proj", None), ("fc2", None), ("mlp.fc2", None)]),
    7: ("mlp_gate", [("mlp.gate_up_proj", 1)]),
}
LAYERS = "language_model.model.layers"


def adapter_from_trtllm(
    name: str,
    weights: np.ndarray,
    config: np.ndarray,
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """The adapter in `weights` [rows, width] (fp16/bf16/fp32) and `config` [rows, 3] (ints), resolved onto `model`'s
    decoder layers; ValueError naming the tensor and row that do not fit."""
    weights, config = np.asarray(weights), np.asarray(config)
    if config.ndim != 2 or config.shape[1] != 3 or not len(config):
        raise ValueError(
            f"lora_config: expected [rows, 3] (module id, layer, adapter size), got {list(config.shape)}"
        )
    if not np.issubdtype(config.dtype, np.integer):
        raise ValueError(f"lora_config: expected integers, got {config.dtype}")
    if weights.ndim != 2 or weights.shape[0] != config.shape[0]:
        raise ValueError(
            f"lora_weights: expected [{config.shape[0]}, width] (a row per lora_config row), "
            f"got {list(weights.shape)}"
        )
    if not np.issubdtype(weights.dtype, np.floating):
        raise ValueError(f"lora_weights: expected floating-point values, got {weights.dtype}")
    layers = model.get_submodule(LAYERS) if _has(model, LAYERS) else None
    digest = hashlib.sha256(
        config.astype(np.int64).tobytes() + weights.astype(np.float32).tobytes()
    ).hexdigest()
    adapter = LoRAAdapter(name, digest, int(config[:, 2].max()))
    seen: set[tuple[str, int]] = set()
    for row, (module_id, layer, rank) in enumerate(config.tolist()):
        where = f"lora_config row {row} (module {module_id}, layer {layer}, adapter size {rank})"
        if module_id not in MODULES:
            raise ValueError(
                f"{where}: module id {module_id} is not supported (0-7: attention and MLP linears of "
                "the decoder layers)"
            )
        if layers is None or not 0 <= layer < len(layers):
            raise ValueError(
                f"{where}: the model has {0 if layers is None else len(layers)} decoder layers"
            )
        if rank < 1:
            raise ValueError(f"{where}: the adapter size must be >= 1")
        module_name, shard = _module(model, f"{LAYERS}.{layer}", module_id, where)
        if (module_name, shard if shard is not None else -1) in seen:
            raise ValueError(f"{where}: this module of this layer has an earlier row")
        seen.add((module_name, shard if shard is not None else -1))
        module = model.get_submodule(module_name)
        full_in, rows = module.full_in_features(), module.full_rows(shard)
        n_in, n_out = rank * full_in, rows * rank
        if n_in + n_out > weights.shape[1]:
            raise ValueError(
                f"lora_weights row {row}: {MODULES[module_id][0]} of layer {layer} with adapter size "
                f"{rank} needs {n_in} + {n_out} values ([{rank}, {full_in}] then "
                f"[{rows}, {rank}]), the row has {weights.shape[1]}"
            )
        values = torch.from_numpy(np.ascontiguousarray(weights[row, : n_in + n_out])).float()
        offset, size, a, b = module.lora_shard(
            shard, rank, values[:n_in].reshape(rank, full_in), values[n_in:].reshape(rows, rank)
        )
        adapter.targets.setdefault(module_name, []).append(
            LoRATarget(offset, size, a.to(device, dtype), b.to(device, dtype))
        )
    return adapter


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _module(model: nn.Module, layer: str, module_id: int, where: str) -> tuple[str, object]:
    """(our module name, shard) of module `module_id` in decoder layer `layer`."""
    for sub, shard in MODULES[module_id][1]:
        name = f"{layer}.{sub}"
        if not _has(model, name):
            continue
        if not model.lora_target_ok(name):
            raise ValueError(
                f"{where}: the layer is a cross-attention layer; LoRA there is not supported"
            )
        return name, shard
    raise ValueError(f"{where}: this model's decoder layers have no {MODULES[module_id][0]} linear")
