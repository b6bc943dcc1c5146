"""Weight-only decoder weights (`quantization="int8" | "int4"`, W8A16 / W4A16) give the logits of transformers
whose decoder projections hold the same integer weights dequantized (q * s per output row; written here
independently of mmserve's code), on the CPU and (gpu-marked) on CUDA, where one-row steps run the Triton GEMVs
over the stored rows; the GEMVs and the few-row GEMM against the formula in Triton's CPU interpreter; the packing and
memory."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from mmserve import LLM
from tests.parity.fp8_case import DEVICES, PARAMS, PROMPT
from tests.parity.hf_oracle import hf_logits

_PROJ = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)")
QMAX = {"int8": 127, "int4": 7}


def _round_trip(w: torch.Tensor, method: str) -> torch.Tensor:
    s = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / QMAX[method]
    return torch.round(w.float() / s).clamp(-QMAX[method], QMAX[method]) * s


def _hf(
    model_dir: str,
    device: str,
    method: str | None,
    prompt: dict = PROMPT,
    adapter: str | None = None,
):
    """transformers' logits with the decoder projections' weights rounded as `method` stores them, then (adapter)
    a LoRA adapter merged on top, as mmserve applies it beside the quantized weights."""

    def prepare(model: nn.Module) -> None:
        for name, module in model.model.language_model.named_modules():
            if method and _PROJ.fullmatch(name) and isinstance(module, nn.Linear):
                module.weight.data = _round_trip(module.weight.data, method).to(module.weight.dtype)
        if adapter is not None:
            from mmserve.testing.lora import merge_lora_into

            merge_lora_into(model, adapter)

    return hf_logits(
        model_dir,
        {k: v for k, v in prompt.items() if k != "lora"},
        PARAMS.max_tokens,
        device,
        prepare if method or adapter else None,
    )


def _in_interpreter(code: str) -> None:
    """Run `code` (which prints ok) in a fresh process with Triton's CPU interpreter on."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def _decoder_linears(llm: LLM) -> dict[str, nn.Module]:
    from mmserve.models.quantization import decoder_linears

    return dict(decoder_linears(llm.engine.model))


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("device", DEVICES)
def test_weight_only_matches_transformers_with_the_same_weights(tiny_llava_dir, device, method):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", quantization=method)
    layers = _decoder_linears(llm)
    stored = torch.int8 if method == "int8" else torch.uint8
    assert len(layers) == 4 * 3 and all(m.weight.dtype == stored for m in layers.values())
    assert all(p.dtype == torch.float32 for p in llm.engine.model.vision_tower.parameters())
    assert llm.engine.model.language_model.lm_head.weight.dtype == torch.float32
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    want, plain = _hf(tiny_llava_dir, device, method), _hf(tiny_llava_dir, device, None)
    tol = 2e-3 if device == "cpu" else 1e-2
    torch.testing.assert_close(out.context_logits, want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(out.generation_logits, want[1], atol=tol, rtol=tol)
    assert (out.context_logits - plain[0]).abs().max() > 10 * tol  # the rounding is really there
    assert llm.engine.kv.usage == 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_one_row_gemv_over_stored_rows_matches_the_formula(method):
    """The Triton GEMVs (here in their CPU interpreter) read the stored rows and apply the row scales after the
    sum; odd sizes leave partial tiles."""
    code = (
        "import torch\n"
        "from mmserve.kernels.gemv import gemv, gemv_int4\n"
        "from mmserve.layers.weight_only import dequantize, quantize_weight_int4, quantize_weight_int8\n"
        "g = torch.Generator().manual_seed(0)\n"
        f"quantize = {'quantize_weight_int8' if method == 'int8' else 'quantize_weight_int4'}\n"
        "w, s = quantize(torch.randn(41, 202, generator=g))\n"
        "x = torch.randn(202, generator=g)\n"
        "b = torch.randn(41, generator=g)\n"
        f"y = {'gemv(x, w, b, weight_scale=s)' if method == 'int8' else 'gemv_int4(x, w, b, s, torch.float32)'}\n"
        "want = x @ dequantize(w, s, torch.float32).t() + b\n"
        "assert torch.allclose(y, want, atol=1e-4), (y - want).abs().max()\n"
        "print('ok')\n"
    )
    _in_interpreter(code)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_few_row_gemm_over_stored_weights_matches_the_formula(method):
    """The Triton GEMM for batched-decode rows (in its CPU interpreter): int8 tiles as they are, int4 bytes against
    x's even and odd columns; partial tiles in M, N and K, with and without bias."""
    code = (
        "import torch\n"
        "from mmserve.kernels.weight_only_gemm import weight_only_gemm\n"
        "from mmserve.layers.weight_only import dequantize, quantize_weight_int4, quantize_weight_int8\n"
        "g = torch.Generator().manual_seed(1)\n"
        f"quantize = {'quantize_weight_int8' if method == 'int8' else 'quantize_weight_int4'}\n"
        "w, s = quantize(torch.randn(41, 74, generator=g))\n"
        "for m, bias in ((5, torch.randn(41, generator=g)), (17, None)):\n"
        "    x = torch.randn(m, 74, generator=g)\n"
        "    want = x @ dequantize(w, s, torch.float32).t() + (0 if bias is None else bias)\n"
        "    y = weight_only_gemm(x, w, s, bias)\n"
        "    assert torch.allclose(y, want, atol=1e-4), (m, (y - want).abs().max())\n"
        "print('ok')\n"
    )
    _in_interpreter(code)


def test_few_row_gemm_over_float_weights_matches_f_linear():
    """The same Triton GEMM over weights in the activations' dtype (small_m_gemm, layers/linear.py's candidate
    against cuBLAS for batched decode), in its CPU interpreter: partial tiles in M, N and K, with and without
    bias."""
    code = (
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from mmserve.kernels.weight_only_gemm import small_m_gemm\n"
        "g = torch.Generator().manual_seed(2)\n"
        "w = torch.randn(41, 74, generator=g)\n"
        "for m, bias in ((5, torch.randn(41, generator=g)), (17, None), (2, None)):\n"
        "    x = torch.randn(m, 74, generator=g)\n"
        "    y = small_m_gemm(x, w, bias)\n"
        "    want = F.linear(x, w, bias)\n"
        "    assert torch.allclose(y, want, atol=1e-4), (m, (y - want).abs().max())\n"
        "print('ok')\n"
    )
    _in_interpreter(code)


def test_int4_packs_two_values_per_byte_and_round_trips():
    from mmserve.layers.weight_only import dequantize, quantize_weight_int4, unpack_int4

    w = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_weight_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 5)
    q = unpack_int4(packed)
    want = torch.round(w / scale[:, None]).clamp(-7, 7)
    assert torch.equal(q.float(), want) and q.min() >= -7 and q.max() <= 7
    assert torch.equal(
        packed[:, 0] & 0xF, (want[:, 0].to(torch.int16) & 0xF).to(torch.uint8)
    )  # low nibble first
    assert (dequantize(packed, scale, torch.float32) - w).abs().max() <= scale.max() / 2 + 1e-6
    with pytest.raises(ValueError, match="must be even"):
        quantize_weight_int4(torch.randn(2, 5))


def test_weight_only_weights_take_one_byte_or_half_a_byte_per_element(tiny_llava_dir):
    plain = _decoder_linears(LLM(tiny_llava_dir, device="cpu", dtype="float32"))
    for method, numel_ratio in (("int8", 1), ("int4", 2)):
        for name, layer in _decoder_linears(
            LLM(tiny_llava_dir, device="cpu", dtype="float32", quantization=method)
        ).items():
            ref = plain[name].weight
            assert (
                layer.weight.element_size() == 1
                and layer.weight.numel() * numel_ratio == ref.numel()
            )
            assert layer.weight_scale.shape == (ref.shape[0],)


def test_lora_adapters_apply_beside_weight_only_layers(tiny_llava_dir, lora_adapters):
    """An adapter's delta is added to the int4 layers' output: transformers with the int4-rounded weights and the
    adapter merged gives the same logits."""
    llm = LLM(
        tiny_llava_dir,
        device="cpu",
        dtype="float32",
        quantization="int4",
        lora_modules=lora_adapters,
    )
    prompt = {**PROMPT, "lora": "alpha"}
    out = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    want = _hf(tiny_llava_dir, "cpu", "int4", prompt, lora_adapters["alpha"])
    torch.testing.assert_close(out.context_logits, want[0], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out.generation_logits, want[1], atol=2e-3, rtol=2e-3)
    without = _hf(tiny_llava_dir, "cpu", "int4")
    assert (out.context_logits - without[0]).abs().max() > 2e-2  # the adapter really is applied
