"""FP8 copies of a checkpoint, laid out as the common FP8 exporters write them, for loader tests offline.

- "modelopt" (NVIDIA ModelOpt / TensorRT-LLM's HF export): e4m3 `weight`, a scalar `weight_scale` per tensor,
  a scalar static `input_scale`; `quantization_config = {"quant_method": "modelopt", "quant_algo": "FP8"}`.
- "compressed-tensors" (llm-compressor FP8_DYNAMIC): e4m3 `weight`, a per-channel `weight_scale` [N, 1], no
  input scale (activations scaled per token at run time).

Only the language model's decoder projections (`*_proj.weight` under `.layers.`) are quantized, minus any
name containing one of `exclude`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
STYLES = ("modelopt", "compressed-tensors")
_DECODER_PROJ = re.compile(r"language_model\..*\.layers\.\d+\..*_proj\.weight$")


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    scale = amax.clamp(min=1e-12) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def write_fp8_checkpoint(
    src: str | Path,
    dst: str | Path,
    style: str = "modelopt",
    input_scale: float = 4.0 / 448,
    exclude: tuple[str, ...] = (),
) -> Path:
    """Copy checkpoint `src` to `dst` with its decoder projections in FP8 (`style`: see STYLES)."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    src, dst = Path(src), Path(dst)
    shutil.copytree(
        src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json")
    )
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _DECODER_PROJ.search(name) or any(e in name for e in exclude):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        out[name], scale = _quantize(t, per_channel=style == "compressed-tensors")
        out[prefix + ".weight_scale"] = scale.reshape(()) if style == "modelopt" else scale
        if style == "modelopt":
            out[prefix + ".input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": list(exclude)}
        if style == "modelopt"
        else {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "ignore": list(exclude),
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "type": "float",
                        "num_bits": 8,
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
        }
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
