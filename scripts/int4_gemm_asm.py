"""Compile the group-wise int4 GEMM (kernels/group_int4_gemm.py `_gemm_kernel`) for an H100 (sm_90a) on any machine,
no GPU needed, and print per tile configuration what ptxas and the PTX say about its K loop: registers, spill
stores, the loop body's instruction count, its global loads and its tensor-core instructions.

    python scripts/int4_gemm_asm.py                      # the decode-batch configs of gemm_configs(32)
    python scripts/int4_gemm_asm.py --configs 16,64,128,4,4 64,128,128,8,3 --dump /tmp/asm

Launches through Triton's JIT specialize integer arguments divisible by 16 and 16-byte aligned pointers; the
compile here passes the same hints (every pointer, N, K, G and stride), so the code is what a GPU launch of the
llava-1.5-7b shapes builds with this machine's Triton (the device's Triton version may differ: check both).
`--dump DIR` writes each config's TTGIR and PTX there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mmserve.kernels.group_int4_gemm import _gemm_kernel, gemm_configs  # noqa: E402
from mmserve.testing.triton_h100 import compile_for_h100  # noqa: E402

POINTERS = {"x_ptr": "*fp16", "w_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*u8", "g_ptr": "*u8"}
POINTERS |= {"b_ptr": "*fp16", "y_ptr": "*fp16"}
ALIGNED = set(POINTERS) | {"N", "K", "G", "stride_x", "stride_w", "stride_y", "stride_split"}


def compile_config(bm: int, bn: int, bk: int, warps: int, stages: int, group: int, split_k: int):
    """The compiled kernel (asm: ttgir, ptx, ...) of one tile configuration, per-group scales, no g_idx."""
    constants = dict(GROUP=group, HAS_G_IDX=False, PER_GROUP=True, HAS_BIAS=False, M_MAJOR=True)
    constants |= dict(SPLIT_K=split_k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PDL=0)
    return compile_for_h100(
        _gemm_kernel, POINTERS, constants, aligned=ALIGNED, num_warps=warps, num_stages=stages
    )


def ptxas_info(ptx: str) -> tuple[int, int]:
    """(registers, spill store bytes) from ptxas -v on the PTX."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        log = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores", log)
    return regs, int(spills.group(1)) if spills else 0


def loop_body(ptx: str) -> list[str]:
    """The opcodes of the first loop's body (from its header label to the branch back)."""
    lines = ptx.splitlines()
    start = next(i for i, line in enumerate(lines) if "Loop Header" in line)
    label = lines[start].split(":")[0]
    end = next(
        i
        for i in range(start + 1, len(lines))
        if re.search(rf"bra(\.uni)?\s+{re.escape(label)};", lines[i])
    )
    ops = []
    for line in lines[start + 1 : end + 1]:
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", line)
        if m and not line.strip().startswith("//"):
            ops.append(m.group(1))
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        nargs="*",
        help="BLOCK_M,BLOCK_N,BLOCK_K,warps,stages (default: gemm_configs(32))",
    )
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--split-k", type=int, default=1)
    ap.add_argument("--top", type=int, default=0, help="also the loop's N most frequent opcodes")
    ap.add_argument("--dump", help="write each config's TTGIR and PTX to this folder")
    args = ap.parse_args()
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    else:
        configs = [
            (
                c.kwargs["BLOCK_M"],
                c.kwargs["BLOCK_N"],
                c.kwargs["BLOCK_K"],
                c.num_warps,
                c.num_stages,
            )
            for c in gemm_configs(32)
        ]
    print(f"triton {triton.__version__}, sm_90a, group {args.group}, split-K {args.split_k}")
    for bm, bn, bk, warps, stages in configs:
        kernel = compile_config(bm, bn, bk, warps, stages, args.group, args.split_k)
        ptx = kernel.asm["ptx"]
        regs, spills = ptxas_info(ptx)
        ops = loop_body(ptx)
        counts = Counter(ops)
        global_loads = sum(n for op, n in counts.items() if op.startswith("ld.global"))
        mma = sum(n for op, n in counts.items() if op.startswith(("wgmma.mma_async", "mma.sync")))
        print(
            f"M{bm} N{bn} K{bk} w{warps} s{stages}: {regs} registers, {spills} B spilled; loop: "
            f"{len(ops)} instructions, {global_loads} global loads, {mma} MMAs"
        )
        if args.top:
            print("   " + ", ".join(f"{op} {n}" for op, n in counts.most_common(args.top)))
        if args.dump:
            out = Path(args.dump)
            out.mkdir(parents=True, exist_ok=True)
            stem = f"int4_gemm_m{bm}_n{bn}_k{bk}_w{warps}_s{stages}"
            (out / f"{stem}.ttgir").write_text(kernel.asm["ttgir"])
            (out / f"{stem}.ptx").write_text(ptx)


if __name__ == "__main__":
    main()
