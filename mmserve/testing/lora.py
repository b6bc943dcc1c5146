"""Random PEFT LoRA adapters for a checkpoint written offline, and the transformers model with one merged in
(the oracle of LoRA serving: W + scaling * B @ A is what the adapter means)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

DECODER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."


def _decoder_linears(model_dir: str | Path, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """HF module name -> (in, out) of the language model's decoder linears named in targets (a meta model)."""
    import transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and "language_model" in name
        and ".layers." in name
        and name.rsplit(".", 1)[-1] in targets
    }


def make_lora_adapter(
    out_dir: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = DECODER_TARGETS,
    seed: int = 0,
    std: float = 0.05,
    use_rslora: bool = False,
) -> Path:
    """Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for the checkpoint at model_dir:
    random A and B (B too, unlike PEFT's zero init, so the adapter changes the answers) on its decoder layers."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in sorted(_decoder_linears(model_dir, targets).items()):
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * std
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(model_dir),
                "r": rank,
                "lora_alpha": alpha,
                "target_modules": list(targets),
                "lora_dropout": 0.0,
                "bias": "none",
                "use_rslora": use_rslora,
                "fan_in_fan_out": False,
            },
            indent=2,
        )
    )
    return out


def merge_lora_into(model: torch.nn.Module, adapter_dir: str | Path) -> None:
    """Add scaling * B @ A of every adapter tensor pair to the transformers model's weights, in place."""
    from safetensors.torch import load_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            linear = modules[key.removeprefix(_PREFIX).removesuffix(".lora_A.weight")]
            linear.weight += (scaling * (b.double() @ a.double())).to(linear.weight.dtype)


# TensorRT-LLM's module ids of the Llama-style decoder linears (its docs/source/advanced/lora.md, hf_lora_convert.py)
TRTLLM_MODULE_IDS = {
    "q_proj": 1,
    "k_proj": 2,
    "v_proj": 3,
    "o_proj": 4,
    "gate_proj": 5,
    "down_proj": 6,
    "up_proj": 7,
}


def trtllm_lora_tensors(
    adapter_dir: str | Path, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """A PEFT adapter as the `lora_weights` [rows, width] and `lora_config` [rows, 3] (module id, layer, rank) that
    TensorRT-LLM's converter writes: a row is A [r, in] then scaling * B [out, r], flattened, padded to the widest."""
    import re

    from safetensors.torch import load_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)
    tensors = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    rows, ids = [], []
    for key in sorted(tensors):
        m = re.match(r".*\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_A\.weight$", key)
        if not m:
            continue
        a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        rows.append(torch.cat([a.flatten(), (b.double() * scaling).float().flatten()]))
        ids.append([TRTLLM_MODULE_IDS[m.group(2)], int(m.group(1)), a.shape[0]])
    width = max(len(r) for r in rows)
    weights = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows]).to(dtype)
    return weights, torch.tensor(ids, dtype=torch.int32)
