"""LoRAAdapter: a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors / .bin) resolved onto our model.

Each target of the adapter is a linear layer of the checkpoint (e.g. `model.language_model.layers.3.self_attn.q_proj`);
it becomes (our module, output rows) through the family's weight renames and the language model's packed modules,
so a q_proj delta lands in the q rows of our fused qkv_proj. The delta of a row x is `scaling * (x @ A^T) @ B^T`
(A [rank, in], B [out, rank]; scaling lora_alpha / r, or / sqrt(r) with rsLoRA).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mmserve.layers.linear import LinearBase

_PEFT_PREFIX = "base_model.model."


@dataclass
class LoRATarget:
    """Where one checkpoint linear's delta goes: rows [offset, offset + size) of our module's output."""

    offset: int
    size: int
    a: torch.Tensor  # [rank, in] (this tensor-parallel rank's input columns)
    b: torch.Tensor  # [size, rank], scaling folded in


@dataclass
class LoRAAdapter:
    name: str
    digest: str  # content hash: part of its requests' prefix-cache keys
    rank: int
    targets: dict[str, list[LoRATarget]] = field(
        default_factory=dict
    )  # our module name -> its parts

    @classmethod
    def load(
        cls, name: str, path: str | Path, model: nn.Module, device: torch.device, dtype: torch.dtype
    ) -> "LoRAAdapter":
        """Read a PEFT adapter directory and resolve it onto `model`; ValueError naming what does not fit."""
        path = Path(path)
        config_file = path / "adapter_config.json"
        if not config_file.is_file():
            raise ValueError(f"LoRA adapter {name!r}: {config_file} not found")
        config = json.loads(config_file.read_text())
        if config.get("peft_type", "LORA").upper() != "LORA":
            raise ValueError(
                f"LoRA adapter {name!r}: peft_type {config.get('peft_type')!r} is not LoRA"
            )
        if config.get("bias", "none") != "none":
            raise ValueError(
                f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')"
            )
        for key in ("use_dora", "fan_in_fan_out"):
            if config.get(key):
                raise ValueError(f"LoRA adapter {name!r}: {key} is not supported")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError(
                f"LoRA adapter {name!r}: per-module rank_pattern / alpha_pattern are not supported"
            )
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
        tensors, digest = _read_tensors(path)
        adapter = cls(name, digest, rank)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            stem, _, kind = key.rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                raise ValueError(
                    f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A / lora_B weight "
                    "(modules_to_save and embedding adapters are not supported)"
                )
            pairs.setdefault(stem, {})[kind[0]] = tensor
        for stem, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise ValueError(
                    f"LoRA adapter {name!r}: {stem} has no lora_{'B' if 'A' in ab else 'A'}"
                )
            module_name, shard = _resolve(model, stem.removeprefix(_PEFT_PREFIX), name)
            module = model.get_submodule(module_name)
            try:
                offset, size, a, b = module.lora_shard(shard, rank, ab["A"], ab["B"])
            except ValueError as e:
                raise ValueError(f"LoRA adapter {name!r}: {stem} has {e}") from None
            adapter.targets.setdefault(module_name, []).append(
                LoRATarget(
                    offset, size, a.to(device, dtype), (b.float() * scaling).to(device, dtype)
                )
            )
        if not adapter.targets:
            raise ValueError(f"LoRA adapter {name!r} has no LoRA weights")
        return adapter


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    safetensors, binary = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if safetensors.is_file():
        from safetensors.torch import load_file

        data = safetensors.read_bytes()
        return load_file(str(safetensors)), hashlib.sha256(data).hexdigest()
    if binary.is_file():
        data = binary.read_bytes()
        return torch.load(str(binary), map_location="cpu", weights_only=True), hashlib.sha256(
            data
        ).hexdigest()
    raise ValueError(
        f"LoRA adapter at {path}: neither adapter_model.safetensors nor adapter_model.bin found"
    )


def _is_linear(model: nn.Module, weight_name: str) -> bool:
    """Whether `<module>.weight` names one of our linear layers (also one whose weight is held quantized, e.g. a
    group-wise int4 layer's `qweight`)."""
    try:
        return isinstance(model.get_submodule(weight_name.removesuffix(".weight")), LinearBase)
    except AttributeError:
        return False


def _resolve(model: nn.Module, hf_module: str, adapter: str) -> tuple[str, object]:
    """(our module name, packed shard id or None) of a checkpoint linear layer of the language model."""
    name = hf_module + ".weight"
    for old, new in model.weight_renames:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    shard = None
    if not _is_linear(model, name):
        for part, (fused, shard_id) in model.lora_packed_modules().items():
            if part in name and _is_linear(model, name.replace(part, fused)):
                name, shard = name.replace(part, fused), shard_id
                break
    module_name = name.removesuffix(".weight")
    if not _is_linear(model, name):
        raise ValueError(
            f"LoRA adapter {adapter!r}: {hf_module} is not a linear layer of this model"
        )
    if not module_name.startswith("language_model.") or module_name.startswith(
        "language_model.lm_head"
    ):
        raise ValueError(
            f"LoRA adapter {adapter!r}: {hf_module} is outside the language model's decoder layers; "
            "only those take LoRA here"
        )
    if not model.lora_target_ok(module_name):
        raise ValueError(
            f"LoRA adapter {adapter!r}: {hf_module} is in a cross-attention layer; LoRA there is not "
            "supported"
        )
    return module_name, shard
