"""Decode-attention latency at LLaVA-7B shapes: Triton kernel vs the torch backend (GPU only).

`PYTHONPATH=. python3 -m tests.kernels.bench_paged_decode [context]`. Prints µs per call; "graph" times a
CUDA-graph replay (kernel time without Python launch overhead), "eager" a plain call.
`... bench_paged_decode sweep [context [heads kv_heads]]`: graph times of the decode kernel's tile choices only
(decode_tile); grouped heads (e.g. `sweep 780 28 4`, Qwen2-7B; `32 8`, Mistral-7B) sweep the tensor-core tiles.
"""

from __future__ import annotations

import sys

import torch
import triton.testing

from mmserve.attention import torch_backend, triton_backend
from mmserve.kernels import paged_decode as kernels
from mmserve.kernels.paged_decode import default_num_splits
from tests.kernels.attention_checks import make_batch

HEADS, HEAD_DIM, BLOCK = 32, 128, 16


def main(context: int) -> None:
    for cache_dtype in (torch.float16, torch.float8_e4m3fn):
        decode_table(context, cache_dtype)
        decode_table(
            context, cache_dtype, head_major=False
        )  # the memory order as indexed (kv_layout.py)
    prefill_line()


# (keys per tile, stages, warps, register cap, CUDA-core kernel): kernels.DecodeTile
SWEEP_TILES = [
    (128, 2, 4, None, False),
    (64, 2, 4, 128, False),
    (32, 2, 4, 96, True),
    (32, 2, 4, 128, True),
    (64, 2, 8, 128, True),
]


# the tensor-core kernel's tiles for grouped heads (the CUDA-core kernel serves one query head per KV head)
GROUPED_SWEEP_TILES = [
    (128, 2, 4, None, False),
    (64, 2, 4, 128, False),
    (64, 2, 4, None, False),
    (32, 2, 4, None, False),
    (128, 2, 8, None, False),
    (128, 3, 4, None, False),
]


def sweep(context: int, heads: int = HEADS, kv_heads: int = HEADS) -> None:
    dev = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    default = kernels.decode_tile
    print(
        f"{torch.cuda.get_device_name()} decode tiles, {heads} heads / {kv_heads} KV heads x {HEAD_DIM}, "
        f"context {context}: graph us (GB/s) per batch, default {[default(HEAD_DIM, 1, 32, heads // kv_heads)]}"
    )
    for cache_dtype in (torch.float16, torch.float8_e4m3fn):
        batches = {
            b: make_batch(
                [1] * b,
                [context] * b,
                heads,
                kv_heads,
                HEAD_DIM,
                BLOCK,
                torch.float16,
                dev,
                extra_blocks=0,
                cache_dtype=cache_dtype,
            )
            for b in (1, 8, 16, 32, 128)
        }
        for tile in SWEEP_TILES if heads == kv_heads else GROUPED_SWEEP_TILES:
            kernels.decode_tile = lambda d_pad, nbytes, num_seqs, group, tile=tile: (
                kernels.DecodeTile(*tile)
            )
            cells = []
            for b, (q, _, _, cache, meta) in batches.items():
                err = (
                    (
                        triton_backend.paged_attention(q, cache, meta, scale).float()
                        - torch_backend.paged_attention(q, cache, meta, scale).float()
                    )
                    .abs()
                    .max()
                    .item()
                )
                assert err < 2e-2, f"tile {tile} batch {b}: max error {err}"
                us = (
                    triton.testing.do_bench_cudagraph(
                        lambda: triton_backend.paged_attention(q, cache, meta, scale), rep=50
                    )
                    * 1e3
                )
                gbs = (
                    2 * b * context * kv_heads * HEAD_DIM * cache.element_size() / (us * 1e-6) / 1e9
                )
                cells.append(f"b{b} {us:7.1f} ({gbs:5.0f})")
            print(f"{str(cache_dtype).split('.')[-1]:>14} {str(tile):>12}  " + "  ".join(cells))
    kernels.decode_tile = default


def decode_table(context: int, cache_dtype: torch.dtype, head_major: bool = True) -> None:
    dev = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    print(
        f"{torch.cuda.get_device_name()}  decode, {HEADS} heads x {HEAD_DIM}, block {BLOCK}, fp16 queries, "
        f"{cache_dtype} cache ({'head' if head_major else 'token'}-major), context {context}"
    )
    print(
        f"{'batch':>5} {'splits':>6} {'triton graph us':>16} {'GB/s':>6} {'triton eager us':>16} {'torch us':>10}"
    )
    for batch in (1, 8, 32, 64, 128):
        q, _, _, cache, meta = make_batch(
            [1] * batch,
            [context] * batch,
            HEADS,
            HEADS,
            HEAD_DIM,
            BLOCK,
            torch.float16,
            dev,
            extra_blocks=0,
            cache_dtype=cache_dtype,
            head_major=head_major,
        )
        splits = default_num_splits(batch, HEADS, meta.block_tables.shape[1] * BLOCK, dev)
        fn = lambda: triton_backend.paged_attention(q, cache, meta, scale)  # noqa: E731
        graph_us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
        eager_us = triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3
        torch_us = (
            triton.testing.do_bench(
                lambda: torch_backend.paged_attention(q, cache, meta, scale), warmup=3, rep=50
            )
            * 1e3
        )
        gbs = (
            2 * batch * context * HEADS * HEAD_DIM * cache.element_size() / (graph_us * 1e-6) / 1e9
        )  # K+V read
        print(
            f"{batch:>5} {splits:>6} {graph_us:>16.1f} {gbs:>6.0f} {eager_us:>16.1f} {torch_us:>10.1f}"
        )


def prefill_line() -> None:
    dev = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    q, _, _, cache, meta = make_batch(
        [2048], [2048], HEADS, HEADS, HEAD_DIM, BLOCK, torch.float16, dev
    )
    pre_us = (
        triton.testing.do_bench(
            lambda: triton_backend.paged_attention(q, cache, meta, scale), rep=50
        )
        * 1e3
    )
    ref_us = (
        triton.testing.do_bench(
            lambda: torch_backend.paged_attention(q, cache, meta, scale), rep=50
        )
        * 1e3
    )
    tflops = 4 * 2048 * 2048 / 2 * HEADS * HEAD_DIM / (pre_us * 1e-6) / 1e12
    print(
        f"prefill 1 x 2048 tokens: triton {pre_us:.1f} us ({tflops:.0f} TFLOP/s causal), torch {ref_us:.1f} us"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["sweep"]:
        sweep(*(int(a) for a in sys.argv[2:5])) if len(sys.argv) > 2 else sweep(780)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
