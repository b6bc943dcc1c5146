"""Triton kernels (paged attention, cache writes, fused ops) match the torch oracle.

Without a GPU the kernels run in Triton's CPU interpreter. TRITON_INTERPRET must be set before the
kernels are defined and would leak into every other test of this process, so all checks run once in a
child process (tests/kernels/triton_checks.py) and each test here reports one check's result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from tests.kernels.triton_checks import CHECKS  # noqa: E402  (defines names only; imports no kernel)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, str | None]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    # on a GPU every check compiles its kernels for it: longer than the interpreter takes for these small shapes
    # (an H100 machine needed more than 300 s, 2026-11-25)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_checks"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500 if torch.cuda.is_available() else 300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (
        f"kernel checks crashed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("check", list(CHECKS))
def test_triton_kernel_matches_torch_oracle(
    check: str, kernel_results: dict[str, str | None]
) -> None:
    assert check in kernel_results, f"check {check} did not run"
    assert kernel_results[check] is None, kernel_results[check]
