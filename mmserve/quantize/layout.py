"""Where a checkpoint keeps what calibrated quantization changes: which families it supports (a Llama-style
decoder: input_layernorm -> q/k/v, o; post_attention_layernorm -> gate/up, down), the smoothing sites of each
decoder layer (`Site`), and the map from our module names (fused `qkv_proj`, `gate_up_proj`) to the checkpoint's
own tensors (`q_proj` / `k_proj` / `v_proj`, `gate_proj` / `up_proj`, the norms), found by running each on-disk
key through the family's renames and packed-module mapping as the loader does.

A tensor's loader name is its key, prefixed by its file's sub-folder (`llm/model.layers.0...` reads
`llm.model.layers.0...`: VILA's layout); the written checkpoint keeps every file where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from torch import nn

from mmserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from mmserve.models.quantization import decoder_linears

# the families the structural check (check_family) admits, for its refusal message; tests/unit/test_quantize_folding.py
# checks this list against every family's test checkpoint
SUPPORTED_FAMILIES = "llava, llava_next, llava_onevision, pixtral, qwen2_vl, vila"


@dataclass(frozen=True)
class TensorRef:
    """One tensor of the checkpoint: its file (relative to the checkpoint) and key, and which part of our
    parameter it fills (None: all of it; "q" / "k" / "v", 0 / 1: a fused parameter's part)."""

    file: str
    key: str
    shard: object = None


@dataclass(frozen=True)
class Site:
    """One smoothing site: scales s [K] divide what `producer` outputs (a norm's weight; the rows of `shard` of
    a linear) and multiply the input columns of `consumers` (our linear module names, one shared input)."""

    producer: str
    consumers: tuple[str, ...]
    shard: object = None  # None: the producer is a norm


def unsupported_reason(model: nn.Module) -> str | None:
    """Why calibrated quantization cannot fold scales into this model's decoder, or None if it can."""
    if model.family.media_lora:
        return "its picture tokens run through a built-in LoRA the scales would have to fold into"
    lm = model.language_model
    if not (isinstance(lm, LlamaForCausalLM) and type(lm.model) is LlamaModel):
        return "its language model is not a Llama-style decoder"
    if not all(type(layer) is LlamaDecoderLayer for layer in lm.model.layers):
        return "its decoder has layers other than Llama's"
    return None


def decoder_sites(model: nn.Module, prefix: str = "language_model.model.layers") -> list[Site]:
    """Each decoder layer's sites: input_layernorm -> qkv; v -> o when o reads v's rows one to one (no GQA);
    post_attention_layernorm -> gate/up; up -> down."""
    sites = []
    for i, layer in enumerate(model.language_model.model.layers):
        p = f"{prefix}.{i}"
        attn = layer.self_attn
        sites.append(Site(f"{p}.input_layernorm", (f"{p}.self_attn.qkv_proj",)))
        if attn.o_proj.weight.shape[1] == attn.kv_size:
            sites.append(Site(f"{p}.self_attn.qkv_proj", (f"{p}.self_attn.o_proj",), "v"))
        sites.append(Site(f"{p}.post_attention_layernorm", (f"{p}.mlp.gate_up_proj",)))
        sites.append(Site(f"{p}.mlp.gate_up_proj", (f"{p}.mlp.down_proj",), 1))
    return sites


class CheckpointLayout:
    """The checkpoint's safetensors files and, for each of our parameters, the tensors that hold it."""

    def __init__(self, root: str | Path, model: nn.Module) -> None:
        self.root = Path(root)
        self.files = sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*.safetensors"))
        if not self.files:
            raise ValueError(f"{root}: no *.safetensors files")
        params = {name for name, _ in model.named_parameters()}
        packed = LlamaForCausalLM.packed_modules
        self.refs: dict[str, list[TensorRef]] = {}  # our parameter name -> its tensors
        self.owner: dict[tuple[str, str], tuple[str, object]] = {}  # (file, key) -> (ours, shard)
        for file in self.files:
            parts = Path(file).parent.parts
            with safe_open(str(self.root / file), framework="pt") as f:
                keys = list(f.keys())
            for key in keys:
                name, shard = _our_name(
                    ".".join((*parts, key)), model.weight_renames, packed, params
                )
                if name in params:
                    self.refs.setdefault(name, []).append(TensorRef(file, key, shard))
                    self.owner[(file, key)] = (name, shard)

    def check_decoder(self, model: nn.Module) -> list[str]:
        """Our decoder linear module names, after checking the checkpoint holds each weight (every part of a
        fused one, as a tensor of its own) and each norm a site folds into. ValueError naming what is not."""
        names = [name for name, _ in decoder_linears(model)]
        lm_prefix = "language_model."
        for name in names:
            refs = self.refs.get(f"{lm_prefix}{name}.weight", [])
            module = model.get_submodule(f"{lm_prefix}{name}")
            expected = _expected_parts(module)
            if sorted(map(str, (r.shard for r in refs))) != sorted(map(str, expected)):
                raise ValueError(
                    f"checkpoint layout not understood: {lm_prefix}{name}.weight is not stored as "
                    f"separate tensors {expected} (found {[r.key for r in refs]})"
                )
        for site in decoder_sites(model):
            if site.shard is None and f"{site.producer}.weight" not in self.refs:
                raise ValueError(f"checkpoint layout not understood: no tensor for {site.producer}")
        return [f"{lm_prefix}{n}" for n in names]


def _expected_parts(module: nn.Module) -> list[object]:
    from mmserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(module, MergedColumnParallelLinear):
        return [0, 1]
    return [None]


def _our_name(
    name: str, renames, packed: dict[str, tuple[str, object]], params: set[str]
) -> tuple[str, object]:
    """The parameter (and part) a checkpoint tensor loads into, as models/weights.load_weights finds it."""
    for old, new in renames:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    for part, (fused, shard) in packed.items():
        if part in name and name.replace(part, fused) in params:
            return name.replace(part, fused), shard
    return name, None
