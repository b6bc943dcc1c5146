"""Time the FP8 decode kernels per llava-1.5-7b shape against fp16 (issue 35 item 4; one CUDA GPU, < 3 minutes).

`python scripts/fp8_decode_bench.py [--hbm 3.35e12]`

Linears (K x N: qkv 4096 x 12288, o 4096 x 4096, gate_up 4096 x 22016, down 11008 x 4096) at M = 1, 8, 32: fp16
cuBLAS (`F.linear`), the fp16 GEMV (M = 1), then every FP8 candidate of `fp8_gemm.few_row_candidates` (the kernels
`run_fastest` chooses among) and cuBLASLt's FP8 GEMM for reference. Each is timed with kernels/fastest.bench_ms
(inside a CUDA graph, each call after an L2 flush: the timer the choice itself uses), so the line marked `<- pick`
is the candidate run_fastest would keep. GB/s counts the weight bytes (fp8 plus fp32 row scales; fp16) over the
time, and the share is of --hbm (H100 SXM: 3.35 TB/s).

Decode attention (32 heads x 128, block 16, context 600) at batch 1 and 32 with an fp16 and an FP8 cache: the
default split count and tile (kernels/paged_decode.py), then for the FP8 cache other split counts; GB/s counts K+V.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mmserve.kernels import paged_decode
from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.fp8_gemm import few_row_candidates, quant_rows, scaled_mm
from mmserve.kernels.gemv import gemv
from mmserve.layers.fp8_linear import quantize_weight
from tests.kernels.attention_checks import make_batch

SHAPES = {"qkv": (4096, 12288), "o": (4096, 4096), "gate_up": (4096, 22016), "down": (11008, 4096)}
ROWS = (1, 8, 32)


def _us(fn) -> float:
    return bench_ms(fn, reps=8, replays=5) * 1e3


def _line(name: str, us: float, nbytes: int, hbm: float, mark: str = "") -> None:
    gbs = nbytes / (us * 1e-6)
    print(f"    {name:<22} {us:8.1f} us {gbs / 1e9:7.0f} GB/s {100 * gbs / hbm:5.1f} % {mark}")


def linears(hbm: float) -> None:
    dev = torch.device("cuda")
    names = ["fp8 small-M GEMM", "fp8 GEMV", "fp8 swap-AB", "fp8 swap-AB split-K"]
    for layer, (k, n) in SHAPES.items():
        w16 = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
        w8, ws = quantize_weight(w16)
        for m in ROWS:
            print(f"{layer} K={k} N={n} M={m}")
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            _line("fp16 cuBLAS", _us(lambda: F.linear(x, w16)), 2 * n * k, hbm)
            if m == 1:
                _line("fp16 GEMV", _us(lambda: gemv(x, w16)), 2 * n * k, hbm)
            xq, xs = quant_rows(x)
            fns = few_row_candidates(xq, xs, w8, ws, None, torch.float16)
            labels = [nm for nm in names if m == 1 or nm != "fp8 GEMV"][: len(fns)]
            times = [_us(fn) for fn in fns]
            for label, us in zip(labels, times):
                _line(label, us, n * k + 4 * n, hbm, "<- pick" if us == min(times) else "")
            _line(
                "fp8 cuBLASLt",
                _us(lambda: scaled_mm(xq, xs, w8, ws, None, torch.float16)),
                n * k + 4 * n,
                hbm,
            )


def attention(hbm: float, context: int = 600) -> None:
    dev = torch.device("cuda")
    heads, head_dim, block = 32, 128, 16
    for batch in (1, 32):
        for cache_dtype in (torch.float16, torch.float8_e4m3fn):
            q, _, _, cache, meta = make_batch(
                [1] * batch, [context] * batch, heads, heads, head_dim, block, torch.float16, dev,
                extra_blocks=0, cache_dtype=cache_dtype,
            )  # fmt: skip
            nbytes = 2 * batch * context * heads * head_dim * cache.element_size()
            default = paged_decode.default_num_splits(
                batch, heads, meta.block_tables.shape[1] * block, dev
            )
            tile = paged_decode.decode_tile(head_dim, cache.element_size(), batch, 1)
            print(
                f"attention batch {batch} context {context} {cache_dtype} cache, tile {tuple(tile)}"
            )
            splits = [default] + (
                [s for s in (1, 2, 3, 4, 8) if s != default] if cache.element_size() == 1 else []
            )
            for s in splits:

                def run(s=s):
                    return paged_decode.paged_decode_attention(
                        q, cache, meta.block_tables, meta.seq_lens, head_dim**-0.5, num_splits=s
                    )

                _line(f"splits {s}{' (default)' if s == default else ''}", _us(run), nbytes, hbm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--hbm", type=float, default=3.35e12, help="peak HBM bytes/s (H100 SXM: 3.35e12)"
    )
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    linears(args.hbm)
    attention(args.hbm)


if __name__ == "__main__":
    main()
