"""kernels/fp8_gemv.py's swapped-operand FP8 GEMM (with and without split-K) and every candidate of
fp8_gemm.few_row_candidates against the exact product of the quantized operands, in Triton's CPU interpreter (one
child process: TRITON_INTERPRET must be set before triton is imported). The interpreter sums in fp32, so the kernels
must agree with the fp64 product to fp32 rounding, and fp16 outputs to one fp16 rounding step."""

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
from mmserve.kernels.fp8_gemm import few_row_candidates
from mmserve.kernels.fp8_gemv import fp8_gemm_swap_ab, split_k_for
from mmserve.layers.fp8_linear import quantize_rows, quantize_weight

g = torch.Generator().manual_seed(0)
out = {"swap": [], "candidates": {}}

def case(m, n, k, bias):
    w, ws = quantize_weight(torch.randn(n, k, generator=g) * 0.1)
    b = torch.randn(n, generator=g) if bias else None
    xq, xs = quantize_rows(torch.randn(m, k, generator=g) * 3)
    exact = (xq.double() @ w.double().t()) * xs.double()[:, None] * ws.double()[None, :]
    return xq, xs, w, ws, b, exact + (b.double() if bias else 0.0)

def rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())

# K 200 / 96 / 40 not multiples of the 32-wide interpreter tile; split 3 of K 40 leaves an empty partition
for m, n, k, bias in [(1, 37, 200, True), (5, 16, 40, False), (17, 70, 96, True), (33, 24, 40, True)]:
    xq, xs, w, ws, b, want = case(m, n, k, bias)
    for split in (1, 3):
        for dtype in (torch.float32, torch.float16):
            got = fp8_gemm_swap_ab(xq, xs, w, ws, b, dtype, split_k=split)
            # fp16: the exact value rounded once to fp16, plus fp32 rounding
            tol = 1e-6 if dtype == torch.float32 else 2 ** -11 + 1e-6
            out["swap"].append([m, n, k, split, str(dtype), list(got.shape), rel(got, want), tol])

# a shape whose split-K candidate exists (fewer than 256 tiles of 64 rows, K >= 1024)
for m in (1, 3):
    xq, xs, w, ws, b, want = case(m, 24, 1024, True)
    fns = few_row_candidates(xq, xs, w, ws, b, torch.float32)
    out["candidates"][m] = [rel(fn(), want) for fn in fns]
out["split_k"] = {f"{n}x{k}": split_k_for(n, k) for n, k in [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (24, 1024), (24, 512)]}
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
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


def test_swap_ab_gemm_equals_the_quantized_product(results: dict) -> None:
    assert len(results["swap"]) == 16
    for m, n, k, split, dtype, shape, err, tol in results["swap"]:
        assert shape == [m, n], (m, n, k, split, dtype)
        assert err <= tol, (
            f"M={m} {n}x{k} split {split} {dtype}: relative error {err:.2e} > {tol:.1e}"
        )


def test_every_few_row_candidate_equals_the_quantized_product(results: dict) -> None:
    # one row: small-M GEMM, GEMV, swapped GEMM, its split-K form; more rows: no GEMV
    assert [len(results["candidates"][m]) for m in ("1", "3")] == [4, 3]
    for m, errs in results["candidates"].items():
        assert max(errs) <= 1e-6, f"M={m}: relative errors {errs}"


def test_split_k_only_where_weight_tiles_leave_sms_idle(results: dict) -> None:
    # llava-1.5-7b: o / down (64 tiles of 64 rows) split in 4; qkv (192) in 2; gate_up (344) not at all
    assert results["split_k"] == {
        "12288x4096": 2,
        "4096x4096": 4,
        "22016x4096": 1,
        "4096x11008": 4,
        "24x1024": 2,
        "24x512": 1,
    }
