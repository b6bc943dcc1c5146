"""The registry of Triton kernel checks (tests/kernels/*_checks.py) and their shared tolerance helper.

Importing it imports no kernel: the check runner sets TRITON_INTERPRET before triton is first imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

CHECKS: dict[str, Callable[[torch.device], None]] = {}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def check(fn: Callable[[torch.device], None]) -> Callable[[torch.device], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def assert_close(
    got: torch.Tensor, want: torch.Tensor, what: str, tol: float | None = None
) -> None:
    tol = tol or TOLERANCE[want.dtype]
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got.float()).all(), f"{what}: non-finite output"
    assert err <= tol * max(1.0, want.float().abs().max().item()), (
        f"{what}: max abs error {err:.3g} > {tol}"
    )


def interpreter_fp8_rounding(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where the Triton CPU interpreter's fp32 -> e4m3 conversion is known to differ from round-to-nearest
    (GPUs convert in hardware and match torch bit for bit): it may round to the other neighbour (adjacent
    codes), and a round-up that carries into the exponent loses the carry (got = want / 2, want a power of 2)."""
    g, w = got.float(), want.float()
    gb, wb = got.view(torch.uint8).int(), want.view(torch.uint8).int()
    adjacent = ((gb >> 7) == (wb >> 7)) & (
        (gb - wb).abs() == 1
    )  # same sign bit (-0 next to the least subnormal)
    carry = (g * 2 == w) & (torch.frexp(w.abs())[0] == 0.5)
    return adjacent | carry
