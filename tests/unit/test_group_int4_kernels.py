"""kernels/group_int4_gemv.py, group_int4_gemm.py and group_int4_dequant.py (the Triton GEMV, GEMM and dequantization
of group-wise int4 weights) against the dequantized fp32 formula, in Triton's CPU interpreter: every row count through
the GEMM with K whole and in 2 or 3 shares, one row also through both GEMV variants, every layout dequantized bit for
bit.
TRITON_INTERPRET must be set before triton is imported and would leak into other tests, so the checks run in one
child process that prints each case's error."""

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
    (5, 16, 96, 48, False, False),  # groups not a power of two: scales looked up per column
    (1, 16, 96, 48, True, True),
    (1, 8, 256, 16, False, True),  # several groups per GEMV tile row
    (1, 16, 136, 8, True, True),  # K = 8.5 blocks of 16: a last half block, groups of 8 (g_idx)
    (4, 24, 136, 8, True, False),
]
_SCRIPT = """
import json, sys, torch
from mmserve.kernels.group_int4_dequant import group_int4_dequant
from mmserve.kernels.group_int4_gemm import gemm_configs, group_int4_gemm
from mmserve.kernels.group_int4_gemv import group_int4_gemv
from mmserve.layers.group_int4 import pack_nibbles_k, quantize_groups
from mmserve.layers.group_int4_linear import dequantize_packed
import mmserve.kernels.group_int4_gemv as kernels
out, dequant_mismatches = [], 0
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
    got = [group_int4_gemm(x, w, s, z, gs, g_idx, bias, split_k=split) for split in (1, 2, 3)]
    if m == 1:  # the GEMV both ways: activations shared by a thread's rows, or read per row
        for shared in (False, True):
            kernels._CPU_GEMV["SHARED_X"] = shared
            got.append(group_int4_gemv(x[0], w, s, z, gs, g_idx, bias)[None])
    out.append(max(float((y - want).abs().max() / want.abs().max()) for y in got))
    for dtype in (torch.float32, torch.float16):  # the interpreter truncates to bf16 (the GPU test has it)
        ref = dequantize_packed(w, s, z, gs, g_idx, dtype)
        dequant_mismatches += int((group_int4_dequant(w, s, z, gs, g_idx, k, dtype) != ref).sum())
# every autotuning candidate (as the GPU runs them) at one shape: K = 384 is 3 groups, less than most tiles
torch.manual_seed(0)
q, s, z = quantize_groups(torch.randn(24, 384), 128)
w, s = pack_nibbles_k(q), s.half()
x = torch.randn(70, 384)
want = x @ dequantize_packed(w, s, z, 128, None, torch.float32).t()
got = [group_int4_gemv(x[0], w, s, z, 128, config=c)[None] for c in kernels.GEMV_CONFIGS]
got = [(y, want[:1]) for y in got] + [
    (group_int4_gemm(x[:m], w, s, z, 128, config=c), want[:m])
    for m in (1, 20, 70)
    for c in gemm_configs(m)
]
out.append(max(float((y - ref).abs().max() / ref.abs().max()) for y, ref in got))
out.append(dequant_mismatches)
# fp16 activations: the GEMM's weights dequantized in fp16 (_fp16_pair) are the reference's rounded once
x16 = x[:20].half()
want16 = x16.float() @ dequantize_packed(w, s, z, 128, None, torch.float16).float().t()
out.append(float((group_int4_gemm(x16, w, s, z, 128).float() - want16).abs().max() / want16.abs().max()))
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


def test_every_kernel_config_matches_dequantized_formula(errors: list[float]) -> None:
    """Each GEMV / GEMM autotuning candidate, at tiles wider than K (one partial tile, masked)."""
    assert errors[len(CASES)] < 1e-5, errors[len(CASES)]


@pytest.mark.parametrize("case", range(len(CASES)), ids=[str(c) for c in CASES])
def test_group_int4_kernel_matches_dequantized_formula(case: int, errors: list[float]) -> None:
    """fp32 activations: the kernels' dequantization ((q - z) * s in fp32) is exact, only summation order differs."""
    assert errors[case] < 1e-5, (CASES[case], errors[case])


def test_dequantization_kernel_equals_the_reference(errors: list[float]) -> None:
    """Every case's weight in fp32 and fp16: (q - z) * s rounded once, equal element for element."""
    assert errors[len(CASES) + 1] == 0, errors[len(CASES) + 1]


def test_fp16_gemm_matches_the_weights_rounded_to_fp16(errors: list[float]) -> None:
    """fp16 activations: the products of exactly the reference's fp16 weights, summed in fp32 and rounded once to
    fp16 (a relative error of at most 2^-11 of the largest output, plus the summation order's)."""
    assert errors[len(CASES) + 2] < 1e-3, errors[len(CASES) + 2]
