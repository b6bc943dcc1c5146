"""Compile a Triton kernel for an H100 (sm_90a) on any machine, no GPU needed: what a GPU launch's compile would
raise (return types that differ between branches, layouts a `tl.dot` cannot take, ptxas errors) shows on a CPU.

Launches through Triton's JIT mark integer arguments divisible by 16 and 16-byte aligned pointers; `aligned` names
the arguments to mark the same way, so the code is what a launch of such shapes builds with this machine's Triton
(the device's Triton version may differ).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)


def compile_for_h100(
    kernel: Any,
    pointers: dict[str, str],
    constants: dict[str, Any],
    *,
    aligned: Iterable[str] = (),
    num_warps: int = 4,
    num_stages: int = 3,
) -> Any:
    """The compiled kernel (its `.asm`: ttgir, ptx, cubin, ...) of `kernel` (a `triton.jit` function, autotuned or
    not) with these pointer types (e.g. "*fp16"), constexpr values, and every other argument an i32."""
    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32")
        for name in fn.arg_names
    }
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn, signature, dict(constants), attrs)
    return triton.compile(
        source, target=H100, options=dict(num_warps=num_warps, num_stages=num_stages)
    )
