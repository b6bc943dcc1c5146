"""INT8 weight-only decoder weights (`quantization="int8"`, W8A16) give the logits of transformers whose decoder
projections hold the same int8 weights dequantized (q * s per output row; written here independently of mmserve's
code), on the CPU and (gpu-marked) on CUDA, where one-row steps run the Triton GEMV over the int8 rows."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mmserve import LLM
from tests.parity.fp8_case import DEVICES, PARAMS, PROMPT
from tests.parity.hf_oracle import hf_logits

_PROJ = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)")


def _int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    s = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(w.float() / s).clamp(-127, 127) * s


def _hf(model_dir: str, device: str, quantized: bool):
    def prepare(model: nn.Module) -> None:
        for name, module in model.model.language_model.named_modules():
            if _PROJ.fullmatch(name) and isinstance(module, nn.Linear):
                module.weight.data = _int8_round_trip(module.weight.data).to(module.weight.dtype)

    return hf_logits(model_dir, PROMPT, PARAMS.max_tokens, device, prepare if quantized else None)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_weights_match_transformers_with_the_same_weights(tiny_llava_dir, device):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", quantization="int8")
    from mmserve.models.quantization import decoder_linears

    layers = dict(decoder_linears(llm.engine.model))
    assert len(layers) == 4 * 3 and all(m.weight.dtype == torch.int8 for m in layers.values())
    assert all(p.dtype != torch.int8 for p in llm.engine.model.vision_tower.parameters())
    assert llm.engine.model.language_model.lm_head.weight.dtype == torch.float32
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    want, plain = _hf(tiny_llava_dir, device, True), _hf(tiny_llava_dir, device, False)
    tol = 2e-3 if device == "cpu" else 1e-2
    torch.testing.assert_close(out.context_logits, want[0], atol=tol, rtol=tol)
    torch.testing.assert_close(out.generation_logits, want[1], atol=tol, rtol=tol)
    assert (out.context_logits - plain[0]).abs().max() > 10 * tol   # the int8 rounding is really there
    assert llm.engine.kv.usage == 0


def test_one_row_gemv_over_int8_rows_matches_the_reference():
    """The Triton GEMV (here in its CPU interpreter) reads int8 rows and applies the row scales after the sum."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from mmserve.kernels.gemv import gemv\n"
        "from mmserve.layers.int8_linear import quantize_weight_int8, dequantize_int8\n"
        "g = torch.Generator().manual_seed(0)\n"
        "w, s = quantize_weight_int8(torch.randn(40, 200, generator=g))\n"
        "x = torch.randn(200, generator=g)\n"
        "b = torch.randn(40, generator=g)\n"
        "y = gemv(x, w, b, torch.ones(1), s, torch.float32)\n"
        "want = x @ dequantize_int8(w, s, torch.float32).t() + b\n"
        "assert torch.allclose(y, want, atol=1e-4), (y - want).abs().max()\n"
        "print('ok')\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_int8_weights_take_one_byte_per_element(tiny_llava_dir):
    from mmserve.models.quantization import decoder_linears

    plain, int8 = (dict(decoder_linears(LLM(tiny_llava_dir, device="cpu", dtype="float32", quantization=q)
                                        .engine.model)) for q in (None, "int8"))
    for name, layer in int8.items():
        assert layer.weight.element_size() == 1 and plain[name].weight.element_size() == 4
        assert layer.weight.shape == plain[name].weight.shape and layer.weight_scale.shape == (layer.weight.shape[0],)
