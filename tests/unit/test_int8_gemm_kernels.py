"""kernels/int8_gemm.py (W8A8's per-token quantization and int8 GEMMs) against layers/w8a8_linear.py's torch
reference, in Triton's CPU interpreter (one child process: TRITON_INTERPRET must be set before triton is imported).
The quantization must equal the reference bit for bit (ties round to even, IEEE divisions); the GEMM's int32 sums
are exact, so with the reference's epilogue order the outputs are equal too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
_SCRIPT = """
import json, torch
from mmserve.kernels.int8_gemm import gemm_configs, int8_gemm, int_mm_scaled, quant_rows_int8
from mmserve.layers.w8a8_linear import int8_matmul, quantize_rows_int8
from mmserve.layers.weight_only import quantize_weight_int8
torch.manual_seed(0)
out = {}
x = torch.randn(4, 100) * 3
x[1] = 0.0  # a zero row
x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])  # ties at scale 1
x[2, 8:] = x[2, 8:].clamp(-127, 127)
q, s = quant_rows_int8(x)
rq, rs = quantize_rows_int8(x)
out["quant"] = torch.equal(q, rq) and torch.equal(s, rs)
amax = x.abs().amax(-1) * 2 + 1  # a row-parallel rank's slice: the whole row's maximum given
q, s = quant_rows_int8(x, amax)
rq, rs = quantize_rows_int8(x, amax)
out["quant_amax"] = torch.equal(q, rq) and torch.equal(s, rs)
errs = []
for m, n, k, bias in [(1, 24, 96, True), (5, 40, 64, False), (20, 16, 136, True), (18, 24, 64, False)]:
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    xs = torch.rand(m) + 0.1
    w, ws = quantize_weight_int8(torch.randn(n, k))
    b = torch.randn(n) if bias else None
    want = int8_matmul(xq, w).float() * xs[:, None] * ws[None, :] + (b if bias else 0)
    ys = [int8_gemm(xq, xs, w, ws, b, torch.float32, c) for c in [None, *gemm_configs(m)]]
    if m > 16:
        ys.append(int_mm_scaled(xq, xs, w, ws, b, torch.float32))
    errs.append(max(float((y - want).abs().max() / want.abs().max()) for y in ys))
out["gemm"] = errs
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
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


def test_per_token_quantization_equals_the_reference_bit_for_bit(results: dict) -> None:
    assert results["quant"] and results["quant_amax"]


def test_int8_gemms_apply_both_scales_and_bias_in_the_epilogue(results: dict) -> None:
    """M = 1 (no padding), K = 136 (not a multiple of the K tile), every autotuning candidate, and cuBLAS's path
    with its epilogue kernel."""
    assert max(results["gemm"]) < 1e-6, results["gemm"]
