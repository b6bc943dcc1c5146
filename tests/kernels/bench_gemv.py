"""Batch-1 linear layers at LLaVA-7B shapes: Triton GEMV vs cuBLAS (GPU only).

`PYTHONPATH=. python3 -m tests.kernels.bench_gemv`. Prints µs per call from CUDA-graph replays (kernel time
without launch overhead) and the weight-read bandwidth each reaches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton.testing

from mmserve.kernels.gemv import _gemv_kernel, gemv

SHAPES = {
    "qkv": (12288, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (22016, 4096),
    "down": (4096, 11008),
    "lm_head": (32064, 4096),
}


def main() -> None:
    print(f"{torch.cuda.get_device_name()}  M=1 fp16 linear")
    print(
        f"{'layer':>8} {'N':>6} {'K':>6} {'cuBLAS us':>10} {'TB/s':>5} {'gemv us':>8} {'TB/s':>5}  config"
    )
    total = [0.0, 0.0]
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        torch.testing.assert_close(gemv(x, w), F.linear(x, w), rtol=2e-2, atol=2e-2)
        t_cublas = triton.testing.do_bench_cudagraph(lambda: F.linear(x, w), rep=100) * 1e3
        t_gemv = triton.testing.do_bench_cudagraph(lambda: gemv(x, w), rep=100) * 1e3
        tb = lambda us: n * k * 2 / us / 1e6  # noqa: E731
        per_step = 1 if name == "lm_head" else 32
        total[0] += t_cublas * per_step
        total[1] += t_gemv * per_step
        print(
            f"{name:>8} {n:>6} {k:>6} {t_cublas:>10.1f} {tb(t_cublas):>5.2f} {t_gemv:>8.1f} {tb(t_gemv):>5.2f}  "
            f"{_gemv_kernel.best_config}"
        )
    print(
        f"one decode step's linears (32 layers + lm_head): cuBLAS {total[0] / 1e3:.2f} ms, gemv {total[1] / 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
