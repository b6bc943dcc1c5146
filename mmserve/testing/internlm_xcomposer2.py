"""Random InternLM-XComposer2-VL checkpoints in the published layout of ``internlm/internlm-xcomposer2-vl-7b``.

Presets: "tiny" (CPU tests: 4 image tokens, Plora rank 8, float32) and "internlm-xcomposer2-vl-7b" (real shapes
and token ids, random float16, for benchmarks). Written: ``config.json`` (remote-code config: ``auto_map`` to the
hub's modules, never run; InternLM2 keys; ``img_size``; no vision config, the tower being hard-coded CLIP ViT-L/14,
:data:`VIT_L14`; a preset with another tower adds a test-only ``vision_config``, see :func:`vision_tower_config`);
``pytorch_model-0000N-of-0000M.bin`` shards (``torch.save``, at least two) with ``pytorch_model.bin.index.json``,
keys as :func:`param_specs` (``wqkv`` and its ``Plora_B`` in InternLM2's interleaved layout, :func:`interleave_wqkv`;
``Plora_B`` random, not zero); ``generation_config.json`` (eos ``</s>`` and ``[UNUSED_TOKEN_145]``); a byte-level
BPE fast tokenizer. The published tokenizer is a sentencepiece ``tokenizer.model`` behind the remote
``InternLMXComposer2Tokenizer``; this one keeps its id layout: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (also pad), the
base vocab, then ``[UNUSED_TOKEN_145]`` (im_end) and ``[UNUSED_TOKEN_146]`` (im_start), the last two ids (92542,
92543 at 7b). ``<ImageHere>`` is no token: prompts are split on it (:func:`prompt_ids`).
:func:`write_xcomposer2_lora_task` writes the Plora weights as the seeds' LoRA task (PEFT + TensorRT-LLM tensors).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    check_divides,
    check_token_ids,
    layer_kind,
    layer_maker,
    meta_tensors,
    replace_sizes,
    vit_kwargs,
)
from mmserve.testing.tokenizer import build_bpe_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, natural_key, plan_shards

if TYPE_CHECKING:
    from transformers import CLIPVisionConfig, PretrainedConfig, PreTrainedTokenizerBase

ARCHITECTURE = "InternLMXComposer2ForCausalLM"
MODEL_TYPE = "internlmxcomposer2"
AUTO_MAP = {
    "AutoConfig": "configuration_internlm_xcomposer2.InternLMXcomposer2Config",
    "AutoModel": "modeling_internlm_xcomposer2.InternLMXComposer2ForCausalLM",
    "AutoModelForCausalLM": "modeling_internlm_xcomposer2.InternLMXComposer2ForCausalLM",
}
IMAGE_TAG = "<ImageHere>"
IM_END, IM_START = "[UNUSED_TOKEN_145]", "[UNUSED_TOKEN_146]"
# build_mlp.py: CLIPVisionTower loads openai/clip-vit-large-patch14-336 and only resizes its position table
VIT_L14 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, patch_size=14)
VIT_L14.update(num_attention_heads=16, hidden_act="quick_gelu", layer_norm_eps=1e-5)
# modeling_internlm2.py builds every PLoRA with lora_r=256, lora_alpha=256: the delta is added unscaled
PLORA_SCALING = 1.0
INDEX = "pytorch_model.bin.index.json"
VIT_PREFIX = "vit.vision_tower.vision_model."  # + CLIPVisionModel's transformers-5 state-dict names
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Plora module -> the Llama-style PEFT module(s) it becomes (wqkv splits into three)
_LORA_NAMES = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj"}
_LORA_NAMES.update({"feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"})


@dataclass(frozen=True)
class XComposer2Sizes:
    """Every size a preset fixes; any field can be overridden by keyword. The defaults are the published model's
    (with random float16 weights)."""

    text_hidden: int = 4096
    text_layers: int = 32
    text_heads: int = 32
    text_kv_heads: int = 8
    text_intermediate: int = 14336
    text_vocab: int = 92542  # base vocab; im_end, im_start follow it: model vocab = text_vocab + 2
    max_position: int = 32768
    init_std: float = 0.02  # matrices and embeddings but Plora's: N(0, init_std)
    plora_rank: int = 256
    plora_std: float = 0.02
    vision_hidden: int = 1024
    vision_layers: int = 24
    vision_heads: int = 16
    vision_intermediate: int = 4096
    image_size: int = 490
    norm_std: float = 0.02  # norm scales 1 + N(0, norm_std); norm shifts and biases N(0, norm_std)
    dtype: str = "float16"
    max_length: int = 4096  # the original cuts prompts at this
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    patch_size: int = 14

    @property
    def bias_std(self) -> float:  # what layer_maker reads
        return self.norm_std


PRESETS: dict[str, XComposer2Sizes] = {
    "tiny": XComposer2Sizes(
        text_hidden=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=128,
        text_vocab=398,
        max_position=512,
        max_length=512,
        init_std=0.2,
        plora_rank=8,
        plora_std=0.15,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        vision_intermediate=64,
        image_size=28,
        norm_std=0.1,
        dtype="float32",
    ),
    "internlm-xcomposer2-vl-7b": XComposer2Sizes(),
}


def xcomposer2_sizes(preset: str = "tiny", **overrides: object) -> XComposer2Sizes:
    """The preset's sizes with ``overrides`` (field names of :class:`XComposer2Sizes`) applied."""
    s = replace_sizes(PRESETS, preset, "internlm_xcomposer2", overrides)
    check_divides(s, ("text_heads", "text_hidden"), ("text_kv_heads", "text_heads"))
    check_divides(s, ("vision_heads", "vision_hidden"), ("patch_size", "image_size"))
    return s


def token_ids(s: XComposer2Sizes) -> dict[str, int]:
    """Special ids: unk, bos, eos (= pad) as InternLM2's; im_end, im_start after the ``text_vocab`` base ids."""
    return dict(unk=0, bos=1, eos=2, pad=2, im_end=s.text_vocab, im_start=s.text_vocab + 1)


def config_dict(s: XComposer2Sizes) -> dict[str, Any]:
    """The ``config.json`` contents of these sizes."""
    ids = token_ids(s)
    d: dict[str, Any] = dict(architectures=[ARCHITECTURE], auto_map=AUTO_MAP, model_type=MODEL_TYPE)
    d.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])
    d.update(bias=False, hidden_act="silu", rope_scaling=None, tie_word_embeddings=False)
    d.update(
        hidden_size=s.text_hidden, intermediate_size=s.text_intermediate, img_size=s.image_size
    )
    d.update(num_attention_heads=s.text_heads, num_key_value_heads=s.text_kv_heads)
    d.update(num_hidden_layers=s.text_layers, vocab_size=s.text_vocab + 2, torch_dtype=s.dtype)
    d.update(max_position_embeddings=s.max_position, max_length=s.max_length, use_cache=True)
    d.update(rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta, initializer_range=s.init_std)
    vision = {k: v for k, v in dict(VIT_L14, **vit_kwargs(s)).items() if k != "image_size"}
    return d if vision == VIT_L14 else dict(d, vision_config=vision)  # test-only, as a dict


def _as_config(d: dict[str, Any]) -> PretrainedConfig:
    import transformers

    fields = dict(d)
    fields["dtype"] = fields.pop("torch_dtype")
    # transformers 5 calls rope_scaling deprecated; the hub config has it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return transformers.PretrainedConfig(**fields)


def internlm_xcomposer2_config(preset: str = "tiny", **overrides: object) -> PretrainedConfig:
    """The config that :func:`make_internlm_xcomposer2_checkpoint` writes (a plain ``PretrainedConfig``: transformers
    has no class), ``architectures == ["InternLMXComposer2ForCausalLM"]``; no weights built."""
    return _as_config(config_dict(xcomposer2_sizes(preset, **overrides)))


def vision_tower_config(config: PretrainedConfig | dict[str, Any]) -> CLIPVisionConfig:
    """The CLIP tower's config: ``vision_config`` when present (test checkpoints), else ViT-L/14, at ``img_size``."""
    from transformers import CLIPVisionConfig

    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return CLIPVisionConfig(**dict(get("vision_config") or VIT_L14), image_size=get("img_size"))


def tokens_per_image(config: PretrainedConfig | dict[str, Any]) -> int:
    """Image embeddings (= placeholder ids) per image: (img_size / patch)^2, the CLS dropped (1225 at 490 px)."""
    vc = vision_tower_config(config)
    return (vc.image_size // vc.patch_size) ** 2


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    num_tokens_per_image: int,
    *,
    bos_every_part: bool = True,
) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, image spans (offset, length)) of a prompt: ``text`` split on ``<ImageHere>``, each non-empty part
    tokenized on its own with BOS, as the hub's IXC2-VL ``interleav_wrap_chat`` and the seeds' Triton preprocessing
    tokenize (default special tokens per part); each image ``num_tokens_per_image`` ids equal to ``unk_token_id``
    at its place.

    ``bos_every_part=False``: BOS on the first part only (the training path ``interleav_wrap``'s ``need_bos``).
    """
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    parts = text.split(IMAGE_TAG)
    first = True
    for i, part in enumerate(parts):
        if part:
            enc = tokenizer(part, add_special_tokens=first or bos_every_part)
            ids.extend(enc["input_ids"])
            first = False
        if i < len(parts) - 1:
            spans.append((len(ids), num_tokens_per_image))
            ids.extend([tokenizer.unk_token_id] * num_tokens_per_image)
    return ids, spans


def interleave_wqkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int
) -> torch.Tensor:
    """Rows of q [heads*d, C], k and v [kv_heads*d, C] packed as InternLM2's ``wqkv``: viewed as
    [kv_heads, heads/kv_heads + 2, d, C], each kv head's queries then its key then its value."""
    d = k.shape[0] // kv_heads
    parts = [t.reshape(kv_heads, -1, d, t.shape[-1]) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, q.shape[-1])


def deinterleave_wqkv(
    wqkv: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) rows of a packed ``wqkv`` (or its Plora_B), the inverse of :func:`interleave_wqkv`."""
    groups = heads // kv_heads
    d = wqkv.shape[0] // (heads + 2 * kv_heads)
    w = wqkv.reshape(kv_heads, groups + 2, d, wqkv.shape[-1])
    return tuple(t.reshape(-1, wqkv.shape[-1]) for t in (w[:, :groups], w[:, -2], w[:, -1]))


def _layer_specs(s: XComposer2Sizes, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    h, r, inter, p = s.text_hidden, s.plora_rank, s.text_intermediate, f"model.layers.{i}."
    qkv = (s.text_heads + 2 * s.text_kv_heads) * (h // s.text_heads)
    linears = {"attention.wqkv": (qkv, h), "attention.wo": (h, h), "feed_forward.w1": (inter, h)}
    linears.update({"feed_forward.w3": (inter, h), "feed_forward.w2": (h, inter)})
    specs = [(f"{p}{n}.weight", (h,), "noisy_norm_weight") for n in ("attention_norm", "ffn_norm")]
    for name, (fan_out, fan_in) in linears.items():
        packed = "qkv" if name == "attention.wqkv" else "matrix"
        specs += [
            (f"{p}{name}.weight", (fan_out, fan_in), packed),
            (f"{p}{name}.Plora_A.weight", (r, fan_in), "matrix"),
            (f"{p}{name}.Plora_B.weight", (fan_out, r), packed),
        ]
    return specs


def param_specs(s: XComposer2Sizes) -> list[tuple[str, tuple[int, ...], str]]:
    """(on-disk name, shape, kind) of every tensor; kind "qkv" is a packed wqkv weight or Plora_B."""
    from transformers import CLIPVisionModel

    h, v = s.text_hidden, s.text_vocab + 2
    specs = [("model.tok_embeddings.weight", (v, h), "matrix")]
    for i in range(s.text_layers):
        specs += _layer_specs(s, i)
    specs += [("model.norm.weight", (h,), "noisy_norm_weight"), ("output.weight", (v, h), "matrix")]
    vc = vision_tower_config(config_dict(s))
    for name, shape, is_norm in meta_tensors(CLIPVisionModel, vc):
        specs.append((VIT_PREFIX + name, shape, layer_kind(name, is_norm, noisy_norm=True)))
    for name, shape in (("0.weight", (h, s.vision_hidden)), ("0.bias", (h,)), ("2.weight", (h, h))):
        specs.append((f"vision_proj.{name}", shape, layer_kind(name, False)))
    return specs + [("vision_proj.2.bias", (h,), "bias")]


def _std(name: str, s: XComposer2Sizes) -> float:
    return s.plora_std if ".Plora_" in name else s.init_std


def wqkv_parts(
    name: str, shape: tuple[int, ...], s: XComposer2Sizes, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k, v rows drawn for the packed tensor ``name`` of ``shape`` (each seeded by ``name`` + ":q" etc.)."""
    make = layer_maker(s, _std, seed)
    kv_rows = shape[0] // (s.text_heads + 2 * s.text_kv_heads) * s.text_kv_heads
    rows = {"q": shape[0] - 2 * kv_rows, "k": kv_rows, "v": kv_rows}
    return tuple(make((f"{name}:{part}", (n, shape[1]), "matrix")) for part, n in rows.items())


def _make_fn(s: XComposer2Sizes, seed: int):
    make = layer_maker(s, _std, seed)

    def make_spec(spec: tuple[str, tuple[int, ...], str]) -> torch.Tensor:
        name, shape, kind = spec
        if kind == "qkv":
            return interleave_wqkv(*wqkv_parts(name, shape, s, seed), s.text_kv_heads)
        return make(spec)

    return make_spec


def build_xcomposer2_tokenizer(s: XComposer2Sizes) -> PreTrainedTokenizerBase:
    """The small BPE in InternLM2's id layout (see the module docstring), checked against :func:`token_ids`."""
    tok = build_bpe_tokenizer([IM_END, IM_START], vocab_size=s.text_vocab, pad="</s>")
    vocab = s.text_vocab + 2
    check_token_ids(tok, token_ids(s), {"im_end": IM_END, "im_start": IM_START}, vocab)
    return tok


def _write_shards(out: Path, specs: list, make: Any, dtype: torch.dtype, max_bytes: int) -> None:
    """``torch.save`` shards ``pytorch_model-0000N-of-0000M.bin`` (at least two) and their index json."""
    specs = sorted(specs, key=lambda sp: natural_key(sp[0]))
    nbytes = [torch.Size(sp[1]).numel() * dtype.itemsize for sp in specs]
    shards = plan_shards(nbytes, min(max_bytes, -(-sum(nbytes) // 2)))
    weight_map = {}
    for k, idx in enumerate(shards):
        fname = f"pytorch_model-{k + 1:05d}-of-{len(shards):05d}.bin"
        torch.save({specs[i][0]: make(specs[i]).to(dtype).contiguous() for i in idx}, out / fname)
        weight_map.update({specs[i][0]: fname for i in idx})
    index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def load_xcomposer2_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's ``.bin`` shards (read through the index), by on-disk name."""
    d = Path(model_dir)
    files = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(torch.load(d / f, map_location="cpu", weights_only=True))
    return out


def make_internlm_xcomposer2_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    lora_dir: str | Path | None = None,
    **overrides: object,
) -> Path:
    """Write a random InternLM-XComposer2-VL checkpoint (layout in the module docstring) into ``out_dir``.

    ``overrides`` are :class:`XComposer2Sizes` fields. A tensor's values depend only on its name and ``seed`` (wqkv
    and its Plora_B: q, k, v drawn apart, then interleaved), so a seed gives byte-identical shards. ``lora_dir``:
    also write the Plora LoRA task there (:func:`write_xcomposer2_lora_task`).
    """
    from transformers import GenerationConfig

    s = xcomposer2_sizes(preset, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("pytorch_model*.bin"), *out.glob(INDEX)]:
        stale.unlink()
    cfg = config_dict(s)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    ids = token_ids(s)
    GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["im_end"]], pad_token_id=ids["pad"]
    ).save_pretrained(out)
    build_xcomposer2_tokenizer(s).save_pretrained(out)
    _write_shards(out, param_specs(s), _make_fn(s, seed), getattr(torch, s.dtype), max_shard_bytes)
    if lora_dir is not None:
        write_xcomposer2_lora_task(out, lora_dir)
    return out


def write_xcomposer2_lora_task(
    model_dir: str | Path, out_dir: str | Path, trt_dtype: torch.dtype = torch.float16
) -> Path:
    """The checkpoint's Plora weights as the seeds' LoRA task in ``out_dir``: a PEFT adapter (r = the Plora rank,
    lora_alpha = r: scaling 1 as the original; Llama names: wqkv's Plora_A shared by q/k/v_proj and its Plora_B
    de-interleaved, wo = o_proj, w1 = gate_proj, w3 = up_proj, w2 = down_proj) and TensorRT-LLM's
    ``model.lora_weights.npy`` [1, rows, width] (``trt_dtype``) / ``model.lora_config.npy`` [1, rows, 3] int32, as
    ``hf_lora_convert.py`` writes them (:func:`~mmserve.testing.lora.trtllm_lora_tensors`)."""
    import numpy as np
    from safetensors.torch import save_file

    from mmserve.testing.lora import trtllm_lora_tensors

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    weights = load_xcomposer2_weights(model_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    rank = 0
    for i in range(cfg["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"base_model.model.model.layers.{i}."
        a, b = (weights[f"{src}attention.wqkv.Plora_{x}.weight"] for x in "AB")
        rank = a.shape[0]
        qkv = deinterleave_wqkv(b, heads, kv_heads)
        for target, part in zip(("q_proj", "k_proj", "v_proj"), qkv):
            tensors[f"{dst}self_attn.{target}.lora_A.weight"] = a.clone()
            tensors[f"{dst}self_attn.{target}.lora_B.weight"] = part.contiguous()
        for name, target in _LORA_NAMES.items():
            for x in "AB":
                tensors[f"{dst}{target}.lora_{x}.weight"] = weights[f"{src}{name}.Plora_{x}.weight"]
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=str(model_dir))
    adapter.update(r=rank, lora_alpha=rank * PLORA_SCALING, target_modules=list(LORA_TARGETS))
    (out / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
    lora_weights, lora_config = trtllm_lora_tensors(out, trt_dtype)
    np.save(out / "model.lora_weights.npy", lora_weights.numpy()[None])
    np.save(out / "model.lora_config.npy", lora_config.numpy()[None])
    return out


CHECKPOINT_WRITERS = {"internlm_xcomposer2": make_internlm_xcomposer2_checkpoint}
TEST_CASES = {"internlm_xcomposer2": FamilyCase(bench_input_len=8)}
