"""kernels/group_int4_gemm.py (the Triton GEMV and GEMM over group-wise int4 weights) against the dequantized fp32
formula, in Triton's CPU interpreter. TRITON_INTERPRET must be set before triton is imported and would leak into
other tests, so the checks run in one child process that prints each case's error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
CASES = [  # (rows, N, K, group_size, act-order g_idx, bias)
    (1, 24, 128, 32, False, True),
    (1, 16, 96, 96, False, False),  # one group per row, K not a multiple of the tile
    (1, 16, 128, 32, True, False),
    (3, 24, 128, 64, False, True),
    (20, 40, 128, 32, True, True),
    (
        5,
        16,
        96,
        48,
        False,
        False,
    ),  # groups not a multiple of the K tile: scales looked up per column
    (1, 16, 96, 48, True, True),
]
_SCRIPT = """
import json, sys, torch
from mmserve.kernels.group_int4_gemm import group_int4_gemm, group_int4_gemv
from mmserve.layers.group_int4 import pack_nibbles_k, quantize_groups
from mmserve.layers.group_int4_linear import dequantize_packed
out = []
for m, n, k, gs, act, has_bias in json.loads(sys.argv[1]):
    torch.manual_seed(m * 1000 + n + k)
    q, s, z = quantize_groups(torch.randn(n, k), gs)
    w, s = pack_nibbles_k(q), s.half()
    g_idx = None
    if act:  # columns of each group scattered across K
        g_idx = (torch.randperm(k) % (k // gs)).int()
    x = torch.randn(m, k)
    bias = torch.randn(n) if has_bias else None
    want = x @ dequantize_packed(w, s, z, gs, g_idx, torch.float32).t() + (bias if has_bias else 0)
    got = group_int4_gemv(x[0], w, s, z, gs, g_idx, bias)[None] if m == 1 else group_int4_gemm(x, w, s, z, gs, g_idx, bias)
    out.append(float((got - want).abs().max() / want.abs().max()))
print("RESULTS " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def errors() -> list[float]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(CASES)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_group_int4_kernel_matches_dequantized_formula(case: int, errors: list[float]) -> None:
    """fp32 activations: the kernels' dequantization ((q - z) * s in fp32) is exact, only summation order differs."""
    assert errors[case] < 1e-5, (CASES[case], errors[case])
