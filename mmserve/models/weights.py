"""Checkpoint loading: stream tensors from a HF directory's safetensors and hand each to the
parameter's own `weight_loader`, after the family's renames and packed-module mapping. FP8 KV cache
scales in the checkpoint (`k_scale` / `v_scale` / `kv_scale`) go to the layers' `Attention` modules.

FP8-quantized checkpoints (an e4m3 `weight` with its `weight_scale`, optionally a static `input_scale`, as
ModelOpt / llm-compressor / TensorRT-LLM's FP8 export them) need no flag: the first such tensor of a linear
layer makes that layer hold FP8 (`LinearBase.make_fp8`), so exactly the layers quantized in the checkpoint are."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.kernels.fp8_format import FP8
from mmserve.layers.attention import Attention
from mmserve.layers.linear import LinearBase, default_weight_loader

_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
_FP8_LEAVES = ("weight_scale", "input_scale")  # a layer gains these when it becomes FP8


def safetensors_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so peak host memory is one tensor, not the checkpoint."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    renames: list[tuple[str, str]] = (),
    packed: dict[str, tuple[str, object]] | None = None,
    ignore: tuple[str, ...] = (),
) -> None:
    """Load checkpoint tensors into model's parameters.

    Args:
        renames: (checkpoint prefix, our prefix) pairs; the first matching prefix is rewritten.
        packed: {".q_proj.": (".qkv_proj.", "q"), ...}: checkpoint parts that fill one fused parameter.
        ignore: substrings of checkpoint names we do not use (e.g. rotary caches, unused heads).
    Raises:
        ValueError naming unknown checkpoint tensors or parameters left unloaded.
    """
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unknown: list[str] = []
    packed = packed or {}
    for ckpt_name, tensor in weights:
        if any(s in ckpt_name for s in ignore):
            continue
        name = ckpt_name
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        shard = None
        for part, (fused, shard_id) in packed.items():
            if part not in name:
                continue
            # only where the model really fuses it (a vision tower may keep separate q/k/v); an FP8 scale
            # names no parameter until its layer turns FP8
            target = name.replace(part, fused)
            if target in params or _is_fp8_tensor_of_linear(modules, target, tensor):
                name, shard = target, shard_id
                break
        if name.endswith(".weight_scale_inv"):
            raise ValueError(
                f"checkpoint tensor {ckpt_name}: block-wise FP8 weights (weight_scale_inv) are not "
                "supported; FP8 checkpoints with per-tensor or per-channel weight_scale are"
            )
        if _is_fp8_tensor_of_linear(modules, name, tensor):
            prefix = name.rpartition(".")[0]
            layer = modules[prefix]
            if not layer.is_fp8:
                layer.make_fp8()
                params.update({f"{prefix}.{n}": p for n, p in layer.named_parameters()})
            if name.endswith(".input_scale"):
                layer.load_input_scale(tensor)
                continue
        param = params.get(name)
        if param is None and _load_kv_scale(modules, name, tensor):
            continue
        if param is None:
            unknown.append(ckpt_name)
            continue
        if param.dtype == FP8 and tensor.dtype != FP8:
            raise ValueError(
                f"checkpoint tensor {ckpt_name} is {tensor.dtype}, but its layer's other tensors are FP8"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        # packed group-wise int4 tensors (int32 words) reach their loader as stored: it unpacks them
        keep = getattr(param, "keeps_checkpoint_dtype", False)
        loader(param, tensor if keep else tensor.to(param.dtype), shard)
        loaded.add(name)
    if unknown:
        raise ValueError(
            f"checkpoint tensors with no matching parameter: {unknown[:8]}"
            + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        )
    missing = [n for n in params if n not in loaded and not getattr(params[n], "tied", False)]
    if missing:
        raise ValueError(f"parameters not found in the checkpoint: {missing[:8]}")


def _is_fp8_tensor_of_linear(
    modules: dict[str, nn.Module], name: str, tensor: torch.Tensor
) -> bool:
    """Whether `name` is an FP8 checkpoint tensor (e4m3 weight, weight_scale, input_scale) of a linear layer."""
    prefix, _, leaf = name.rpartition(".")
    if not isinstance(modules.get(prefix), LinearBase):
        return False
    return leaf in _FP8_LEAVES or (leaf == "weight" and tensor.dtype == FP8)


def _load_kv_scale(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> bool:
    """Set an FP8 KV cache scale from `<self_attn>.k_scale`, `.v_scale`, `.kv_scale` (both), also found
    under `.k_proj.` / `.v_proj.` (as quantization tools export them). Returns whether `name` was one.

    A per-head or per-shard scale tensor becomes its maximum: one scale per layer, never too small to
    represent a value. Caches in the model's dtype ignore the scales.
    """
    suffix = next((s for s in _KV_SCALE_SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return False
    prefix = name[: -len(suffix)].removesuffix(".k_proj").removesuffix(".v_proj")
    attn = modules.get(prefix)
    if not isinstance(attn, Attention):
        attn = modules.get(prefix + ".attn")
    if not isinstance(attn, Attention):
        return False
    value = float(tensor.float().max())
    if not value > 0:
        raise ValueError(
            f"checkpoint tensor {name}: an FP8 KV cache scale must be > 0, got {value}"
        )
    if suffix in (".k_scale", ".kv_scale"):
        attn.k_scale = value
    if suffix in (".v_scale", ".kv_scale"):
        attn.v_scale = value
    return True


def split_grouped_qkv(
    packed: torch.Tensor, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused QKV tensor whose rows go per key/value head (group): the group's queries, its key, its value
    (Megatron's `linear_qkv`, InternLM2's `wqkv`; a weight, a bias or a LoRA B) -> (q, k, v) rows."""
    rest = packed.shape[1:]
    grouped = packed.reshape(kv_heads, -1, head_dim, *rest)
    return (
        grouped[:, :-2].reshape(-1, *rest),
        grouped[:, -2].reshape(-1, *rest),
        grouped[:, -1].reshape(-1, *rest),
    )
