"""The quantized checkpoint on disk: the source directory's files copied (configs, tokenizer, processor, every
non-decoder tensor unchanged), each safetensors shard rewritten where it was with the smoothing scales folded
in and each decoder linear's `weight` replaced, under the checkpoint's own names, by
- AWQ: AutoAWQ's GEMM layout, `qweight` int32 [K, N/8], `qzeros` int32 [G, N/8], `scales` fp16 [G, N]
  (config.json: quant_method "awq", version "gemm", bits 4, zero_point, modules_to_not_convert);
- SmoothQuant: compressed-tensors "int-quantized" (llm-compressor's W8A8), `weight` int8 [N, K] and
  `weight_scale` [N, 1], activations int8 per token at run time (config.json: quant_method "compressed-tensors").
Biases stay in the model's dtype. The shards' index (`model.safetensors.index.json`) is rewritten to match.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mmserve.quantize.layout import CheckpointLayout

INDEX = "model.safetensors.index.json"


@dataclass
class Folding:
    """The smoothing scales, by where they fold: `columns` multiply a linear's input columns (our module name ->
    s [K]); `divisors` divide a producer's output ((our module name, part) -> s: a norm's weight with part None,
    the rows and bias of a fused linear's part)."""

    columns: dict[str, torch.Tensor] = field(default_factory=dict)
    divisors: dict[tuple[str, object], torch.Tensor] = field(default_factory=dict)


def awq_config(group_size: int) -> Callable[[list[str], set[str]], dict]:
    """AutoAWQ's quantization_config; modules_to_not_convert are substrings of module names."""
    return lambda kept, leaves: {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "modules_to_not_convert": kept,
    }


def w8a8_config(kept: list[str], leaves: set[str]) -> dict:
    """compressed-tensors' W8A8 quantization_config (llm-compressor's fields)."""

    def args(strategy: str, dynamic: bool, observer: str) -> dict:
        return {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": strategy,
            "dynamic": dynamic,
            "group_size": None,
            "block_structure": None,
            "actorder": None,
            "observer": observer,
            "observer_kwargs": {},
        }

    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": args("channel", False, "minmax"),
                "input_activations": args("token", True, "memoryless"),
                "output_activations": None,
            }
        },
        "ignore": ignore_patterns(kept, leaves),
        "kv_cache_scheme": None,
    }


def fold(
    tensor: torch.Tensor, module: str, shard: object, leaf: str, folding: Folding
) -> torch.Tensor:
    """`tensor` (fp32) with the scales folded in: divided by its producer scales (rows / norm elements),
    its columns multiplied by its consumer scales."""
    div = folding.divisors.get((module, shard))
    if div is not None:
        tensor = tensor / (div[:, None] if tensor.dim() == 2 else div)
    cols = folding.columns.get(module)
    if cols is not None and leaf == "weight":
        tensor = tensor * cols[None, :]
    return tensor


def write_checkpoint(
    layout: CheckpointLayout,
    out: str | Path,
    quantized: set[str],
    folding: Folding,
    quantize: Callable[[torch.Tensor, torch.dtype], dict[str, torch.Tensor]] | None,
    quantization_config: Callable[[list[str], set[str]], dict] | None,
) -> list[str]:
    """Write the checkpoint to `out`: every decoder linear of `quantized` (our module names) folded and, with
    `quantize` (smoothed fp32 weight, its dtype -> tensors by leaf name), replaced by its quantized tensors;
    `quantization_config(kept module names or folders, kept leaf names)` goes into config.json (None: no quantization, the smoothed
    checkpoint in its dtype). Returns the files written (relative)."""
    out = Path(out)
    shutil.copytree(
        layout.root, out, ignore=shutil.ignore_patterns("*.safetensors", INDEX), dirs_exist_ok=True
    )
    kept: list[tuple[str, str]] = []  # (file, key) of the other 2-D weights
    decoder_keys: list[tuple[str, str]] = []
    weight_maps: dict[Path, dict[str, str]] = {}
    for file in layout.files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(layout.root / file), framework="pt") as f:
            metadata = f.metadata() or {}
            for key in f.keys():
                tensor = f.get_tensor(key)
                ours, shard = layout.owner.get((file, key), (key, None))
                module, _, leaf = ours.rpartition(".")
                converted = module in quantized and leaf == "weight"
                if converted:
                    decoder_keys.append((file, key))
                elif key.endswith(".weight") and tensor.dim() == 2:  # a linear's or an embedding's
                    kept.append((file, key))
                if not (converted or (module, shard) in folding.divisors):
                    tensors[key] = tensor  # as it was, bit for bit
                    continue
                smoothed = fold(tensor.float(), module, shard, leaf, folding)
                if converted and quantize is not None:
                    stem = key.removesuffix(".weight")
                    for name, value in quantize(smoothed, tensor.dtype).items():
                        tensors[f"{stem}.{name}"] = value.contiguous()
                    continue
                tensors[key] = smoothed.to(tensor.dtype)
        save_file(tensors, str(out / file), metadata={"format": "pt", **metadata})
        index_dir = (layout.root / file).parent
        if (index_dir / INDEX).exists():
            weight_maps.setdefault(Path(file).parent, {}).update(
                {k: Path(file).name for k in tensors}
            )
    for folder, weight_map in weight_maps.items():
        _write_index(out / folder, weight_map)
    if quantization_config is not None:
        _write_configs(out, layout, kept, decoder_keys, quantization_config)
    return list(layout.files)


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    total = sum((folder / name).stat().st_size for name in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _write_configs(
    out: Path,
    layout: CheckpointLayout,
    kept: list[tuple[str, str]],
    decoder_keys: list[tuple[str, str]],
    quantization_config: Callable[[list[str], set[str]], dict],
) -> None:
    """config.json's quantization_config at the root and in each sub-folder holding decoder weights (VILA's
    llm/, which AutoAWQ and llm-compressor read as a checkpoint of its own), module names in that folder's frame."""
    folders = {Path(".")} | {Path(f).parent for f, _ in decoder_keys}
    for folder in sorted(folders):
        path = out / folder / "config.json"
        if not path.exists():
            continue
        config = json.loads(path.read_text())
        leaves = _names(kept, folder)
        config["quantization_config"] = quantization_config(
            not_converted(leaves, _names(decoder_keys, folder)), set(leaves)
        )
        path.write_text(json.dumps(config, indent=2) + "\n")


def _names(keys: list[tuple[str, str]], folder: Path) -> list[str]:
    """Module names of (file, key) pairs under `folder`, as a checkpoint rooted there names them."""
    out = []
    for file, key in keys:
        parent = Path(file).parent
        if folder == Path(".") or folder in parent.parents or parent == folder:
            parts = parent.relative_to(folder).parts if parent != Path(".") else ()
            out.append(".".join((*parts, key.removesuffix(".weight"))))
    return out


def not_converted(kept: list[str], converted: list[str]) -> list[str]:
    """The kept modules as few names as can say it: each one's shortest ancestor holding no converted module
    (`model.vision_tower` for the whole tower), else itself. AutoAWQ matches these as substrings of module
    names, compressed-tensors as names or `re:` patterns (`ignore_patterns`)."""
    out: list[str] = []
    for name in sorted(kept):
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            prefix = ".".join(parts[:n])
            if not any(c == prefix or c.startswith(prefix + ".") for c in converted):
                break
        if prefix not in out:
            out.append(prefix)
    return out


def ignore_patterns(names: list[str], leaves: set[str]) -> list[str]:
    """compressed-tensors' ignore list: a leaf module's exact name, a folder's `re:` pattern of everything in it."""
    return [n if n in leaves else f"re:{re.escape(n)}\\..*" for n in names]
