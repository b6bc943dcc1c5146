"""Time the W8A8 int8 and group-wise int4 kernels against fp16 cuBLAS per llava-1.5-7b layer shape (issue 33).

`python scripts/quant_kernel_bench.py` (one CUDA GPU) builds random weights for each decoder linear (K x N: qkv
4096 x 12288, o 4096 x 4096, gate_up 4096 x 22016, down 11008 x 4096), then for M = 1, 8, 32, 128, 512 rows times,
with kernels/fastest.bench_ms (inside a CUDA graph, each call after an L2 flush, as the autotuners time):

- fp16: `F.linear` (cuBLAS), the baseline;
- w8a8: the whole layer (`w8a8_linear`: quantization + GEMM, as served), the quantization kernel alone, the Triton
  int8 GEMM (autotuned, then each config), kernels/gemv.py's GEMV (M = 1), cuBLAS `_int_mm` with its epilogue
  kernel (M > 16);
- int4 (groups of 128): the whole layer (`group_int4_linear`), the GEMV (M = 1; autotuned, then each config), the
  GEMM (autotuned, then each config), dequantize + cuBLAS (M >= 128).

Each line gives the time in us, the rate of weight reads (the method's stored bytes: int8 with fp32 row scales;
int4 at half a byte plus an fp16 scale and a uint8 zero per 128 weights) in GB/s and as a share of --hbm (H100 SXM:
3.35 TB/s), the time against fp16's, and for M >= 128 the TFLOP/s. `--no-configs` skips the per-config lines (each
config is compiled once: most of the run's time).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.gemv import gemv
from mmserve.kernels.group_int4_dequant import group_int4_dequant
from mmserve.kernels.group_int4_gemm import _gemm_kernel, gemm_configs, group_int4_gemm
from mmserve.kernels.group_int4_gemv import GEMV_CONFIGS, _gemv_kernel, group_int4_gemv
from mmserve.kernels.int8_gemm import gemm_configs as int8_configs
from mmserve.kernels.int8_gemm import int8_gemm, int_mm_scaled, quant_rows_int8
from mmserve.kernels.m_tiles import SMALL_M
from mmserve.layers.group_int4 import pack_nibbles_k, quantize_groups
from mmserve.layers.group_int4_linear import group_int4_linear
from mmserve.layers.w8a8_linear import w8a8_linear
from mmserve.layers.weight_only import quantize_weight_int8

SHAPES = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}
ROWS = (1, 8, 32, 128, 512)
GROUP = 128


def _time(fn) -> float:
    """bench_ms with fewer repetitions than the autotuners use: the whole run stays within a few minutes."""
    return bench_ms(fn, reps=8, replays=5)


def _config_name(config) -> str:
    tiles = ",".join(
        f"{k[6:] if k.startswith('BLOCK_') else k}={v}" for k, v in config.kwargs.items()
    )
    return f"[{tiles} w{config.num_warps} s{config.num_stages}]"


class Report:
    """Prints one line per timing against the shape's fp16 time."""

    def __init__(self, hbm: float) -> None:
        self.hbm, self.fp16_ms = hbm, 1.0

    def line(self, label: str, m: int, k: int, n: int, weight_bytes: float, ms: float) -> None:
        gbs = weight_bytes / (ms * 1e-3) / 1e9
        flops = f"  {2 * m * n * k / (ms * 1e-3) / 1e12:6.1f} TFLOP/s" if m >= 128 else ""
        print(
            f"  {label:<44} {ms * 1e3:9.1f} us {gbs:7.0f} GB/s {100 * gbs * 1e9 / self.hbm:5.1f} %"
            f"  x{self.fp16_ms / ms:5.2f} vs fp16{flops}",
            flush=True,
        )


def bench_shape(
    name: str, k: int, n: int, rows: list[int], configs: bool, report: Report, device: str = "cuda"
) -> None:
    """Print the timings of one layer shape at each row count."""
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, generator=gen, dtype=torch.float16) * 0.02
    wq, ws = quantize_weight_int8(w.float())
    q, s, z = quantize_groups(w.float(), GROUP)
    w4, s4 = pack_nibbles_k(q), s.half()
    del q, s
    int8_bytes = n * k + 4 * n
    int4_bytes = w4.numel() + 3 * s4.numel()
    for m in rows:
        print(f"{name} K={k} N={n} M={m}", flush=True)
        x = torch.randn(m, k, device=device, generator=gen, dtype=torch.float16)
        report.fp16_ms = _time(lambda: F.linear(x, w))
        report.line("fp16 F.linear (cuBLAS)", m, k, n, 2 * n * k, report.fp16_ms)

        xq, xs = quant_rows_int8(x)
        timed = [
            ("w8a8 linear (quant + GEMM, as served)", lambda: w8a8_linear(x, wq, ws)),
            ("w8a8 quant_rows_int8 alone", lambda: quant_rows_int8(x)),
            ("w8a8 int8_gemm (autotuned)", lambda: int8_gemm(xq, xs, wq, ws, None, x.dtype)),
        ]
        if m == 1:
            timed.append(("w8a8 int8 GEMV (kernels/gemv.py)", lambda: gemv(xq, wq, None, xs, ws)))
        if m > 16:
            timed.append(
                ("w8a8 _int_mm + epilogue", lambda: int_mm_scaled(xq, xs, wq, ws, None, x.dtype))
            )
        if configs:
            for c in int8_configs(m):
                timed.append(
                    (
                        f"w8a8 int8_gemm {_config_name(c)}",
                        lambda c=c: int8_gemm(xq, xs, wq, ws, None, x.dtype, c),
                    )
                )
        for label, fn in timed:
            report.line(label, m, k, n, int8_bytes, _time(fn))

        args = (w4, s4, z, GROUP)
        timed = [("int4 linear (as served)", lambda: group_int4_linear(x, *args))]
        if m == 1:
            timed.append(("int4 GEMV (autotuned)", lambda: group_int4_gemv(x, *args)))
            if configs:
                for c in GEMV_CONFIGS:
                    timed.append(
                        (
                            f"int4 GEMV {_config_name(c)}",
                            lambda c=c: group_int4_gemv(x, *args, config=c),
                        )
                    )
        timed.append(("int4 GEMM (autotuned)", lambda: group_int4_gemm(x, *args)))
        if 1 < m <= SMALL_M:
            for split in (2, 4):
                timed.append(
                    (
                        f"int4 GEMM split-K {split} (autotuned)",
                        lambda split=split: group_int4_gemm(x, *args, split_k=split),
                    )
                )
        if configs:
            for c in gemm_configs(m):
                timed.append(
                    (
                        f"int4 GEMM {_config_name(c)}",
                        lambda c=c: group_int4_gemm(x, *args, config=c),
                    )
                )
        if m >= 128:
            timed.append(
                (
                    "int4 dequantize (Triton) + cuBLAS",
                    lambda: F.linear(x, group_int4_dequant(*args, None, k, x.dtype)),
                )
            )
        for label, fn in timed:
            report.line(label, m, k, n, int4_bytes, _time(fn))
            if label.endswith("(autotuned)"):  # the autotuner's pick for the call just timed
                tuner = _gemv_kernel if label.startswith("int4 GEMV") else _gemm_kernel
                print(f"    autotuner's pick: {_config_name(tuner.best_config)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="M values")
    parser.add_argument("--no-configs", action="store_true", help="skip the per-config lines")
    parser.add_argument("--hbm", type=float, default=3.35e12, help="HBM bandwidth, bytes/s")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    report = Report(args.hbm)
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        bench_shape(name, k, n, rows, not args.no_configs, report)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
