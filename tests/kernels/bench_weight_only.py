"""Weight-only int8 / int4 linears at LLaVA-7B decoder shapes against fp16 cuBLAS (GPU only).

`PYTHONPATH=. python3 -m tests.kernels.bench_weight_only [--rows 1,8,32,64,600,4096]`. Prints µs per call
(and, for 2..64 rows, the Triton small-M GEMM over the fp16 weights themselves)
(kernels/fastest.py `bench_ms`: CUDA-graph replays after an L2 flush, as the engine's kernel choice times them),
the weight bytes per µs, the sum over one step's decoder linears (32 layers), and for more than 64 rows both
large-M paths (Triton's in-register dequantization, cuBLAS on a dequantized copy) with the one the layer picks.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.m_tiles import SMALL_M
from mmserve.kernels.weight_only_gemm import small_m_gemm, weight_only_gemm
from mmserve.layers.weight_only import (
    dequantize,
    quantize_weight_int4,
    quantize_weight_int8,
    weight_only_linear,
)

SHAPES = {
    "qkv": (12288, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (22016, 4096),
    "down": (4096, 11008),
}
QUANTIZE = {"int8": quantize_weight_int8, "int4": quantize_weight_int4}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64,600,4096")
    rows_list = [int(r) for r in ap.parse_args().rows.split(",")]
    print(f"{torch.cuda.get_device_name()}  weight-only linears vs fp16 cuBLAS; µs per call")
    for m in rows_list:
        totals = {"fp16": 0.0, "int8": 0.0, "int4": 0.0}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            t16 = bench_ms(lambda: F.linear(x, w)) * 1e3
            totals["fp16"] += 32 * t16
            line = [f"M={m:<5} {name:>8} fp16 {t16:8.1f} ({n * k * 2 / t16 / 1e6:4.2f} TB/s)"]
            if (
                1 < m <= SMALL_M
            ):  # the Triton GEMM over the fp16 weights, cuBLAS's rival in layers/linear.py
                t16t = bench_ms(lambda: small_m_gemm(x, w, None)) * 1e3
                totals["fp16 triton"] = totals.get("fp16 triton", 0.0) + 32 * t16t
                line.append(f"fp16 triton {t16t:8.1f} ({n * k * 2 / t16t / 1e6:4.2f} TB/s)")
            for method, quantize in QUANTIZE.items():
                q, s = quantize(w)
                want = x.float() @ dequantize(q, s, torch.float32).t()
                got = weight_only_linear(x, q, s).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                t = bench_ms(lambda: weight_only_linear(x, q, s)) * 1e3
                totals[method] += 32 * t
                line.append(
                    f"{method} {t:8.1f} ({q.numel() * q.element_size() / t / 1e6:4.2f} TB/s, err {err:.1e})"
                )
                if m > SMALL_M:
                    tri = bench_ms(lambda: weight_only_gemm(x, q, s, None)) * 1e3
                    deq = bench_ms(lambda: F.linear(x, dequantize(q, s, x.dtype))) * 1e3
                    line.append(f"[triton {tri:.1f} / dequant {deq:.1f}]")
            print("  ".join(line), flush=True)
        print(
            f"M={m}: one step's decoder linears (32 layers): "
            + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in totals.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
