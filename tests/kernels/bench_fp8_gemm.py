"""FP8 W8A8 linear vs fp16 at LLaVA-7B (Llama-2-7B) shapes (GPU only): correctness against the torch
reference, then µs per call (CUDA-graph replay) for fp16 `linear`, the whole fp8 path as dispatched (row
quantization + GEMM), and each fp8 GEMM alone: the one-row GEMV, the small-M Triton GEMM and cuBLASLt.

`PYTHONPATH=. python3 -m tests.kernels.bench_fp8_gemm [M ...]`.
"""

from __future__ import annotations

import sys

import torch
import triton.testing

from mmserve.kernels.fp8_gemm import fp8_gemm_small_m, fp8_gemv, fp8_matmul, quant_rows, scaled_mm
from mmserve.layers.fp8_linear import fp8_linear_reference, quantize_rows, quantize_weight
from mmserve.layers.linear import linear

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


def check(dev: torch.device) -> None:
    torch.manual_seed(0)
    for m in (1, 5, 64, 640):
        for static in (False, True):
            x = torch.randn(m, 4096, device=dev, dtype=torch.float16)
            w, ws = quantize_weight(torch.randn(1024, 4096, device=dev) * 0.02)
            bias = torch.randn(1024, device=dev, dtype=torch.float16)
            s_in = torch.tensor([0.02], device=dev) if static else None
            q, s = quant_rows(x, s_in)
            q_ref, s_ref = quantize_rows(x, s_in)
            same = (q.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
            y = fp8_matmul(x, w, ws, s_in, bias)
            ref = fp8_linear_reference(x, w, ws, s_in, bias)
            err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            print(
                f"check M={m:<4} static={static!s:<5} quant bytes equal {same:.6f} scales equal "
                f"{torch.equal(s, s_ref)}  max rel err {err:.2e}"
            )


def bench(ms: list[int], dev: torch.device) -> None:
    print(
        f"{torch.cuda.get_device_name()}  W8A8 fp8 vs fp16 linear, µs per call (CUDA-graph replay; each call uses "
        f"the next of several weight copies, >= 200 MB in all, so weights come from HBM, not L2, as in a model)"
    )
    print(
        f"{'shape':>8} {'M':>5} {'fp16':>8} {'fp8 all':>8} {'speedup':>8} {'quant':>7} {'gemv':>7} {'triton':>7} "
        f"{'cublas':>7} {'fp16 TF/s':>9} {'fp8 TF/s':>9}"
    )
    for name, (n, k) in SHAPES.items():
        copies = max(1, -(-200 * 2**20 // (n * k)))  # fp8 bytes; fp16 copies are twice that
        w16s = [torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for _ in range(copies)]
        w8s = [quantize_weight(w) for w in w16s]

        def time(call) -> float:  # µs per weight copy
            return (
                triton.testing.do_bench_cudagraph(lambda: [call(*w) for w in w8s], rep=30)
                * 1e3
                / copies
            )

        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            xq, xs = quant_rows(x)
            gemms = {
                "gemv": lambda w, s: fp8_gemv(xq, xs, w, s, None, x.dtype),
                "triton": lambda w, s: fp8_gemm_small_m(xq, xs, w, s, None, x.dtype),
                "cublas": lambda w, s: scaled_mm(xq, xs, w, s, None, x.dtype),
            }
            if m > 1:
                gemms.pop("gemv")
            if m > 256:
                gemms.pop("triton")
            for fn in [lambda w, s: fp8_matmul(x, w, s, None, None), *gemms.values()]:
                fn(*w8s[0])  # autotune outside the graph
            linear(x, w16s[0])
            t16 = (
                triton.testing.do_bench_cudagraph(lambda: [linear(x, w) for w in w16s], rep=30)
                * 1e3
                / copies
            )
            t8 = time(lambda w, s: fp8_matmul(x, w, s, None, None))
            tq = triton.testing.do_bench_cudagraph(lambda: quant_rows(x), rep=30) * 1e3
            tg = {g: time(fn) for g, fn in gemms.items()}
            cols = " ".join(
                f"{tg[g]:>7.1f}" if g in tg else f"{'-':>7}" for g in ("gemv", "triton", "cublas")
            )
            flops = 2 * m * n * k
            print(
                f"{name:>8} {m:>5} {t16:>8.1f} {t8:>8.1f} {t16 / t8:>8.2f} {tq:>7.1f} {cols} "
                f"{flops / t16 / 1e6:>9.0f} {flops / t8 / 1e6:>9.0f}"
            )
        w16s = w8s = None  # the timing closure holds them: dropped before the next shape


if __name__ == "__main__":
    device = torch.device("cuda")
    check(device)
    bench([int(a) for a in sys.argv[1:]] or [1, 2, 8, 16, 32, 64, 128, 256, 640, 2048], device)
