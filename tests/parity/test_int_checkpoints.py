"""AWQ, GPTQ (with and without act-order) and compressed-tensors W8A8 checkpoints of tiny random LLaVA and Qwen2-VL
models (written by mmserve.testing.quantized from the group_int4 packings) served through `mmserve.LLM` on the CPU.

Oracles:
- exact: the fp32 model whose decoder projections hold the weights the checkpoint stands for ((q - z) * s,
  written beside it) gives the same logits up to summation order (atol 1e-4) and the same greedy tokens;
- the original fp32 model, within a bound derived from the quantization steps. Every stored weight is within half a
  step (s / 2, s the group's scale) of the original (asserted per layer); a relative weight perturbation
  rho_l = ||W_q - W||_F / ||W||_F of layer l moves the logits, to first order, by at most gain * rho_l * max|logits|
  with the network's gain near 1 for these normalised layers: we allow 2 * sum_l rho_l * max|logits| (W8A8 adds
  each layer's activation rounding, at most 1 / 254 of the row's largest entry per element, to rho_l). Measured on
  this model: 0.4 x sum rho (int4), 0.8 x (W8A8). Int4 moves these random tiny models' logits a lot (~10 % per
  matrix), so the dequantized model, not this bound, is the sharp check;
- `--quantization int4_g128 | w8a8` at load equals the AWQ / W8A8 checkpoint written from the same weights;
- two tensor-parallel shards (gloo) give one process's tokens and log-probs: group boundaries on the shard
  boundary, not on it (K / tp not a multiple of the group: every rank keeps all groups' scales), act-order g_idx;
- a LoRA adapter on an AWQ model gives what it gives on the dequantized model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mmserve import LLM, SamplingParams
from mmserve.models.quantization import checkpoint_scheme, decoder_linears
from mmserve.testing.llava import make_llava_checkpoint
from mmserve.testing.quantized import write_quantized_checkpoint
from tests.parity.fp8_case import PARAMS, PROMPT

GREEDY = SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0, logprobs=2)
TEXT = {"prompt": "tell me about it number 3 and then tell me more"}
VARIANTS = {  # name -> (method, writer keywords)
    "awq-g64": ("awq", dict(group_size=64)),
    "gptq-g64": ("gptq", dict(group_size=64)),
    "gptq-g64-act-order": ("gptq", dict(group_size=64, act_order=True)),
    "gptq-g128-sym-act-order": ("gptq", dict(group_size=128, act_order=True, sym=True)),
    "gptq-per-row": ("gptq", dict(group_size=-1)),
    "w8a8": ("w8a8", {}),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A tiny LLaVA whose decoder widths (128, 256) hold whole groups of 64 and 128 columns."""
    root = tmp_path_factory.mktemp("int_ckpt")
    return make_llava_checkpoint(root / "src", seed=3, text_hidden=128, text_intermediate=256)


def _write(src: Path, variant: str) -> tuple[Path, Path]:
    method, kw = VARIANTS[variant]
    dst, deq = src.parent / variant, src.parent / f"{variant}-dequantized"
    if not dst.exists():
        write_quantized_checkpoint(src, dst, method, dequantized_dst=deq, **kw)
    return dst, deq


def _run(model_dir: Path, prompt: dict = PROMPT, **kw):
    out = LLM(str(model_dir), device="cpu", dtype="float32", **kw).generate(
        [prompt], PARAMS, use_tqdm=False
    )
    return out[0]


def _rho(src: Path, deq: Path) -> float:
    """sum over decoder projections of ||W_q - W||_F / ||W||_F, and checks every element is within half a step."""
    total = 0.0
    with (
        safe_open(str(src / "model.safetensors"), "pt") as a,
        safe_open(str(deq / "model.safetensors"), "pt") as b,
    ):
        for name in a.keys():
            if (
                re.search(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$", name)
                and "vis" not in name
            ):
                w, wq = a.get_tensor(name).float(), b.get_tensor(name).float()
                total += float((wq - w).norm() / w.norm())
    return total


def _half_step_holds(src: Path, dst: Path, method: str, group_size: int) -> None:
    """Every dequantized weight within s / 2 (+ the fp16 rounding of s, 16 * s * 2^-11) of the original."""
    from mmserve.layers.group_int4 import dequantize_groups, unpack_awq, unpack_gptq

    with (
        safe_open(str(src / "model.safetensors"), "pt") as a,
        safe_open(str(dst / "model.safetensors"), "pt") as b,
    ):
        name = "language_model.model.layers.0.mlp.down_proj"
        w = a.get_tensor(name + ".weight").float()
        t = {leaf: b.get_tensor(f"{name}.{leaf}") for leaf in ("qweight", "qzeros", "scales")}
        if method == "awq":
            q, z, s = unpack_awq(**t)
            g_idx = None
        else:
            q, z, s, g_idx = unpack_gptq(**t, g_idx=b.get_tensor(name + ".g_idx"))
    g = (
        g_idx
        if g_idx is not None
        else torch.arange(w.shape[1]) // (w.shape[1] if group_size == -1 else group_size)
    )
    err = (dequantize_groups(q, s, z, group_size, g_idx) - w).abs()
    assert bool((err <= s[:, g] * (0.5 + 16 * 2**-11) + 1e-6).all())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpoint_gives_its_dequantized_models_logits(src, variant):
    method, kw = VARIANTS[variant]
    dst, deq = _write(src, variant)
    llm = LLM(str(dst), device="cpu", dtype="float32")
    got, exact = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0], _run(deq)
    layers = dict(decoder_linears(llm.engine.model))
    assert (
        all(m.quant is not None for m in layers.values()) and len(layers) == 3 * 4
    )  # qkv, o, gate_up, down
    if method != "w8a8":
        assert got.outputs[0].token_ids == exact.outputs[0].token_ids
        torch.testing.assert_close(got.context_logits, exact.context_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            got.generation_logits, exact.generation_logits, atol=1e-4, rtol=1e-4
        )
        _half_step_holds(src, dst, method, kw["group_size"])
    ref = _run(src)
    rho = _rho(src, deq) + (len(layers) / 254 if method == "w8a8" else 0.0)
    bound = 2 * rho * ref.context_logits.abs().max().item()
    assert (got.context_logits - ref.context_logits).abs().max().item() <= bound
    assert (
        rho > 0
    )  # the weights did change (int4 RTN: ~10 % per matrix, where the dequantized oracle is the test)


def test_load_time_quantization_equals_the_checkpoints(src):
    """RTN at load (int4_g128, w8a8) quantizes as the writers do: the same logits as the written checkpoints."""
    for method, variant in (("int4_g128", "awq-g128"), ("w8a8", "w8a8")):
        VARIANTS.setdefault("awq-g128", ("awq", dict(group_size=128)))
        dst, _ = _write(src, variant)
        at_load, ckpt = _run(src, quantization=method), _run(dst)
        assert at_load.outputs[0].token_ids == ckpt.outputs[0].token_ids
        torch.testing.assert_close(
            at_load.context_logits, ckpt.context_logits, atol=1e-5, rtol=1e-5
        )


def test_qwen2_vl_awq_and_w8a8(tmp_path):
    """Another family (QKV with bias, its own renames): small groups (8) over its 80 / 136 widths."""
    from mmserve.testing.qwen2_vl import make_qwen2_vl_checkpoint

    qsrc = make_qwen2_vl_checkpoint(tmp_path / "src", seed=1)
    for method in ("awq", "gptq", "w8a8"):
        dst = write_quantized_checkpoint(
            qsrc,
            tmp_path / method,
            method,
            group_size=8,
            act_order=method == "gptq",
            sym=method == "gptq",
            dequantized_dst=tmp_path / f"{method}-d",
        )
        got, exact, ref = (_run(d, TEXT) for d in (dst, tmp_path / f"{method}-d", qsrc))
        if method != "w8a8":
            torch.testing.assert_close(
                got.context_logits, exact.context_logits, atol=1e-4, rtol=1e-4
            )
        rho = _rho(qsrc, tmp_path / f"{method}-d") + (3 * 4 / 254 if method == "w8a8" else 0.0)
        assert (
            got.context_logits - ref.context_logits
        ).abs().max() <= 2 * rho * ref.context_logits.abs().max()


def test_modules_to_not_convert_stay_in_the_models_dtype(src, tmp_path):
    dst = write_quantized_checkpoint(
        src, tmp_path / "awq", "awq", group_size=64, exclude=("mlp.down_proj",)
    )
    layers = dict(decoder_linears(LLM(str(dst), device="cpu", dtype="float32").engine.model))
    for name, layer in layers.items():
        if name.endswith("down_proj"):
            assert layer.quant is None and layer.weight.dtype == torch.float32
        else:
            assert layer.quant is not None and layer.qweight.dtype == torch.uint8


def test_two_shards_match_one(src):
    """awq-g128: o_proj's 128 input columns split 64 / 64, half a group per rank (all scales + g_idx kept);
    gptq act-order: each rank's slice of g_idx; w8a8: per-row scales of whole rows."""
    VARIANTS.setdefault("awq-g128", ("awq", dict(group_size=128)))
    prompts = [TEXT, {"prompt": "one two three four"}]
    for variant in ("awq-g128", "gptq-g64-act-order", "w8a8"):
        dst, _ = _write(src, variant)
        with LLM(str(dst), device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
            two = llm.generate(prompts, GREEDY, use_tqdm=False)
        one = LLM(str(dst), device="cpu", dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
        for a, b in zip(two, one):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, variant
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert all(abs(la[t].logprob - lp.logprob) < 1e-4 for t, lp in lb.items()), variant


@pytest.mark.parametrize("variant", ["awq-g64", "gptq-g64-act-order"])
def test_lora_on_int4_equals_lora_on_the_dequantized_model(src, tmp_path, variant):
    from mmserve.testing.lora import make_lora_adapter

    adapter = str(make_lora_adapter(tmp_path / "lora", src, seed=5))
    dst, deq = _write(src, variant)
    prompt = {**PROMPT, "lora": "a"}
    got = _run(dst, prompt, lora_modules={"a": adapter})
    want = _run(deq, prompt, lora_modules={"a": adapter})
    plain = _run(dst)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    torch.testing.assert_close(got.context_logits, want.context_logits, atol=1e-4, rtol=1e-4)
    assert (got.context_logits - plain.context_logits).abs().max() > 1e-3  # the adapter did apply


@pytest.mark.parametrize(
    "qc,named",
    [
        ({"quant_method": "awq", "version": "gemv", "bits": 4}, "AWQ version 'gemv'"),
        ({"quant_method": "awq", "version": "gemv_fast", "bits": 4}, "AWQ version 'gemv_fast'"),
        ({"quant_method": "awq", "version": "marlin", "bits": 4}, "AWQ version 'marlin'"),
        ({"quant_method": "awq", "version": "gemm", "bits": 3}, "AWQ with 3 bits"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"},
            "checkpoint_format 'gptq_v2'",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "is_marlin_format": True},
            "checkpoint_format 'marlin'",
        ),
        ({"quant_method": "gptq", "bits": 8}, "GPTQ with 8 bits"),
        ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3 bits"),
        (
            {"quant_method": "compressed-tensors", "format": "pack-quantized"},
            "format 'pack-quantized'",
        ),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ],
)
def test_other_layouts_are_refused_by_name(qc, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        checkpoint_scheme(qc)


def test_static_or_asymmetric_w8a8_is_refused(src, tmp_path):
    import json

    dst, _ = _write(src, "w8a8")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = (
        False
    )
    bad = tmp_path / "static"
    bad.mkdir()
    for f in dst.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="input_activations"):
        LLM(str(bad), device="cpu", dtype="float32")
