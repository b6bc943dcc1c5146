"""Integer-quantized copies of a checkpoint, laid out as the published quantizers write them, for loader tests
offline; and, for each, the plain checkpoint whose weights are the ones the quantized copy stands for (the oracle:
a model serving the quantized copy computes what the plain one does, up to summation order).

- "awq": AutoAWQ GEMM layout (qweight / qzeros / scales), round to nearest with zero points per `group_size`
  input columns; `quantization_config = {"quant_method": "awq", "version": "gemm", ...}`.
- "gptq": GPTQ's "gptq" checkpoint format (qweight / qzeros (zero - 1) / scales / g_idx); `act_order` permutes the
  columns before grouping them (desc_act: g_idx scattered), `sym` uses the symmetric zero 8.
- "w8a8": compressed-tensors "int-quantized" (llm-compressor's W8A8): int8 `weight` and a per-channel
  `weight_scale` [N, 1]; activations dynamic per token.

Only the language model's decoder projections are quantized (not the vision tower, projector or LM head), minus
any name containing one of `exclude` (listed in the config's `modules_to_not_convert` / `ignore`).
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mmserve.layers.group_int4 import dequantize_groups, pack_awq, pack_gptq, quantize_groups
from mmserve.layers.weight_only import quantize_weight_int8

METHODS = ("awq", "gptq", "w8a8")
_DECODER_PROJ = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def _is_decoder_proj(name: str, exclude: tuple[str, ...]) -> bool:
    return (
        bool(_DECODER_PROJ.search(name))
        and "vision" not in name
        and "visual" not in name
        and not any(e in name for e in exclude)
    )


def _quantize(w: torch.Tensor, method: str, group_size: int, act_order: bool, sym: bool, seed: int):
    """(checkpoint tensors of one layer, the weight they stand for in fp32)."""
    if method == "w8a8":
        q, scale = quantize_weight_int8(w)
        return {"weight": q, "weight_scale": scale[:, None]}, q.float() * scale[:, None]
    k = w.shape[1]
    perm = (
        torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        if act_order
        else torch.arange(k)
    )
    q_p, scales, zeros = quantize_groups(w[:, perm], group_size, zero_point=not sym)
    q = torch.empty_like(q_p)
    q[:, perm] = q_p
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // (k if group_size == -1 else group_size)
    scales = scales.half().float()  # as stored
    if method == "awq":
        tensors = pack_awq(q, zeros, scales)
    else:
        tensors = pack_gptq(q, zeros, scales, g_idx)
    return tensors, dequantize_groups(q, scales, zeros, group_size, g_idx)


def _config(
    method: str, group_size: int, act_order: bool, sym: bool, exclude: tuple[str, ...]
) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "version": "gemm",
            "bits": 4,
            "group_size": group_size,
            "zero_point": True,
            "modules_to_not_convert": list(exclude) or None,
        }
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": sym,
            "checkpoint_format": "gptq",
            "modules_to_not_convert": list(exclude) or None,
        }
    groups = {"targets": ["Linear"], "weights": {}, "input_activations": {}}
    groups["weights"] = dict(
        num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False
    )
    groups["input_activations"] = dict(
        num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": groups},
        "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*multi_modal_projector.*", *exclude],
    }


def write_quantized_checkpoint(
    src: str | Path,
    dst: str | Path,
    method: str,
    group_size: int = 128,
    act_order: bool = False,
    sym: bool = False,
    exclude: tuple[str, ...] = (),
    dequantized_dst: str | Path | None = None,
) -> Path:
    """Copy checkpoint `src` to `dst` with its decoder projections quantized by `method` (see METHODS); with
    `dequantized_dst`, also write `src` there with those projections replaced by the fp32 weights they stand for."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if act_order and method != "gptq":
        raise ValueError("act_order (a permuted g_idx) exists only in GPTQ checkpoints")
    src, dst = Path(src), Path(dst)
    copies = [dst] + ([Path(dequantized_dst)] if dequantized_dst is not None else [])
    for d in copies:
        shutil.copytree(
            src, d, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json")
        )
    out: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not _is_decoder_proj(name, exclude):
                    out[name] = plain[name] = t
                    continue
                prefix = name.removesuffix(".weight")
                # projections of one input share GPTQ's act-order (its Hessian's): one permutation for q/k/v,
                # one for gate/up
                key = re.sub(
                    r"\.(q|k|v)_proj\.", ".qkv.", re.sub(r"\.(gate|up)_proj\.", ".gate_up.", name)
                )
                tensors, deq = _quantize(
                    t.float(), method, group_size, act_order, sym, zlib.crc32(key.encode())
                )
                out.update({f"{prefix}.{leaf}": v.contiguous() for leaf, v in tensors.items()})
                plain[name] = deq.to(torch.float32)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _config(method, group_size, act_order, sym, exclude)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if dequantized_dst is not None:
        save_file(plain, str(Path(dequantized_dst) / "model.safetensors"))
    return dst
