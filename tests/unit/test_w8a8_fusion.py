"""W8A8 int8 with the per-token activation quantization fused into the norm / activation that produces the rows.

- kernels/fused_ops.py's rms_norm (with and without the residual add) and silu_and_mul, asked for int8 rows, write
  exactly quantize_rows_int8 of their own unfused outputs (Triton's CPU interpreter, one child process: the
  interpreter must be set before triton is imported), and a W8A8 layer given those rows returns bit for bit what it
  returns quantizing the unfused output itself;
- models/quantization.fuse_activation_quantization pairs each decoder layer's input norm, post-attention norm and
  SiLU-and-mul with its int8 consumer at one rank; at two, the row-parallel down_proj keeps quantizing its own
  slice (scaled by the whole row's maximum, a max over the ranks);
- the served model's logits are the same, to the bit, when every paired W8A8 layer takes its input as the int8 rows
  its producer hands it (QuantizedRows) instead of quantizing it itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmserve import LLM
from mmserve.kernels.fp8_format import QuantizedRows
from mmserve.layers.w8a8_linear import quantize_rows_int8, w8a8_linear
from mmserve.layers.weight_only import quantize_weight_int8
from tests.parity.fp8_case import PARAMS, PROMPT

REPO = Path(__file__).resolve().parents[2]
_SCRIPT = """
import json, torch
from mmserve.kernels.fused_ops import rms_norm, silu_and_mul
from mmserve.layers.w8a8_linear import quantize_rows_int8, w8a8_linear
from mmserve.layers.weight_only import quantize_weight_int8

def same(got, want_y):
    q, s = quantize_rows_int8(want_y)
    return (got.q.dtype == torch.int8 and got.dtype == want_y.dtype and torch.equal(got.q, q)
            and torch.equal(got.scale, s))

g = torch.Generator().manual_seed(5)
out = {}
for dtype in (torch.float32, torch.float16):
    w = torch.randn(48, generator=g).to(dtype)
    x = (torch.randn(5, 48, generator=g) * 4).to(dtype)
    x[2] = 0  # a zero row: the floor scale
    res = torch.randn(5, 48, generator=g).to(dtype)
    res[2] = 0
    gate_up = (torch.randn(4, 80, generator=g) * 3).to(dtype)
    tag = str(dtype).removeprefix("torch.")
    out["rms_norm_" + tag] = same(rms_norm(x, w, 1e-5, quantize=True, rows_dtype=torch.int8),
                                  rms_norm(x, w, 1e-5))
    got, got_res = rms_norm(x, w, 1e-5, res, quantize=True, rows_dtype=torch.int8)
    want, want_res = rms_norm(x, w, 1e-5, res)
    out["rms_norm_residual_" + tag] = same(got, want) and torch.equal(got_res, want_res)
    rows = silu_and_mul(gate_up, quantize=True, rows_dtype=torch.int8)
    out["silu_and_mul_" + tag] = same(rows, silu_and_mul(gate_up))
    wq, ws = quantize_weight_int8(torch.randn(24, 40, generator=g))
    out["linear_" + tag] = torch.equal(w8a8_linear(rows, wq, ws), w8a8_linear(silu_and_mul(gate_up), wq, ws))
empty = silu_and_mul(gate_up[:0], quantize=True, rows_dtype=torch.int8)
out["empty"] = empty.q.shape == (0, 40) and empty.q.dtype == torch.int8
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kernel", ["rms_norm", "rms_norm_residual", "silu_and_mul"])
def test_fused_kernels_write_the_int8_rows_of_their_unfused_output(interpreted, kernel, dtype):
    assert interpreted[f"{kernel}_{dtype}"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_w8a8_layer_takes_a_producers_int8_rows_as_its_own(interpreted, dtype):
    assert interpreted[f"linear_{dtype}"] and interpreted["empty"]


def test_w8a8_linear_skips_quantizing_rows_that_come_quantized():
    """Rows handed over quantized are used as they are: scaled rows give a different product than the rows'
    own quantization would, so the layer cannot have quantized again."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, generator=g)
    wq, ws = quantize_weight_int8(torch.randn(16, 32, generator=g))
    q, s = quantize_rows_int8(x)
    assert torch.equal(w8a8_linear(QuantizedRows(q, s, x.dtype), wq, ws), w8a8_linear(x, wq, ws))
    doubled = w8a8_linear(QuantizedRows(q, s * 2, x.dtype), wq, ws)
    torch.testing.assert_close(doubled, 2 * w8a8_linear(x, wq, ws))


@pytest.fixture(scope="module")
def w8a8_llm(tiny_llava_dir) -> LLM:
    return LLM(tiny_llava_dir, device="cpu", dtype="float32", quantization="w8a8")


def test_norms_and_activation_quantize_for_their_int8_layers(w8a8_llm):
    layers = w8a8_llm.engine.model.language_model.model.layers
    for layer in layers:
        assert layer.input_layernorm._consumer == (layer.self_attn.qkv_proj,)
        assert layer.post_attention_layernorm._consumer == (layer.mlp.gate_up_proj,)
        assert layer.mlp.act._consumer == (layer.mlp.down_proj,)  # one rank: whole rows
        assert layer.mlp.down_proj.weight.dtype == torch.int8
        assert layer.input_layernorm.quantize_args(torch.zeros(2, 4)) == {}  # rows on CUDA only


def test_logits_equal_when_producers_hand_int8_rows(w8a8_llm):
    """The CPU's norms return plain tensors (the fused kernels run on CUDA), so each paired consumer here gets its
    input as the rows the fused kernel writes (quantize_rows_int8 of it, bit for bit as checked above)."""
    unfused = w8a8_llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    model = w8a8_llm.engine.model

    def as_rows(module, args):
        (x,) = args
        return (QuantizedRows(*quantize_rows_int8(x.reshape(-1, x.shape[-1])), x.dtype),)

    consumers = [m._consumer[0] for m in model.modules() if getattr(m, "_consumer", ())]
    assert len(consumers) == 3 * len(model.language_model.model.layers)
    hooks = [c.register_forward_pre_hook(as_rows) for c in consumers]
    try:
        fused = w8a8_llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    finally:
        for h in hooks:
            h.remove()
    assert fused.outputs[0].token_ids == unfused.outputs[0].token_ids
    assert torch.equal(fused.context_logits, unfused.context_logits)
    assert torch.equal(fused.generation_logits, unfused.generation_logits)


def test_row_parallel_int8_layer_quantizes_its_own_rows(tiny_llava_dir):
    """Under tensor parallelism down_proj's input is a slice of each row, scaled by the whole row's maximum (a max
    over the ranks): SiLU-and-mul does not quantize for it; the norms still feed their column-parallel layers."""
    with LLM(
        tiny_llava_dir, device="cpu", dtype="float32", tensor_parallel_size=2, quantization="w8a8"
    ) as llm:
        for layer in llm.engine.model.language_model.model.layers:
            assert layer.mlp.down_proj.in_features * 2 == layer.mlp.down_proj.full_in_features()
            assert layer.mlp.act._consumer == ()
            assert layer.input_layernorm._consumer == (layer.self_attn.qkv_proj,)
            assert layer.post_attention_layernorm._consumer == (layer.mlp.gate_up_proj,)
