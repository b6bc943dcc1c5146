"""Does a mixed step's compute-bound work overlap its memory-bound work on this GPU? (issue 35 item 3, one CUDA GPU,
< 1 minute)

`python scripts/overlap_probe.py [--tokens 2030] [--seqs 191] [--context 700] [--layers 4]`

The FP8 / fp16 throughput runs' mixed steps (~2,030 tokens of which ~191 decode rows, contexts ~600-800) spend their
GPU time in two halves that run one after the other: the prompt GEMMs of each decoder layer (qkv, o, gate_up, down of
llava-1.5-7b, compute-bound) and the decode attention over the paged KV cache (memory-bound). NanoFlow-style
nano-batching only pays if the two can run at the same time on one GPU. This probe times, for `--layers` layers:
the GEMMs alone, the decode attention alone, both back to back on one stream, and both at once on two streams (the
GEMMs of one nano-batch beside the attention of another), each as a CUDA graph replay (no launch gaps) timed with CUDA
events, median of 20. It prints the overlap gained: (back to back - two streams) / the shorter of the two halves
(1.0 = the shorter half hidden completely, 0 = no overlap).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from mmserve.kernels import paged_decode
from tests.kernels.attention_checks import make_batch

# llava-1.5-7b's decoder linears as (K, N)
SHAPES = [(4096, 12288), (4096, 4096), (4096, 22016), (11008, 4096)]
HEADS, HEAD_DIM, BLOCK = 32, 128, 16


def _graph(work) -> torch.cuda.CUDAGraph:
    """`work` captured once (after a warm-up on a side stream, as CUDA graph capture wants)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    return graph


def _ms(graph: torch.cuda.CUDAGraph, rounds: int = 20) -> float:
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2030, help="rows through the GEMMs per layer")
    parser.add_argument("--seqs", type=int, default=191, help="decode sequences in the attention")
    parser.add_argument(
        "--context", type=int, default=700, help="tokens of each decode sequence's context"
    )
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for k, n in SHAPES]
    inputs = {k: torch.randn(args.tokens, k, device=dev, dtype=torch.float16) for k, _ in SHAPES}
    q, _, _, cache, meta = make_batch(
        [1] * args.seqs, [args.context] * args.seqs, HEADS, HEADS, HEAD_DIM, BLOCK, torch.float16, dev,
        extra_blocks=0,
    )  # fmt: skip

    def gemms() -> None:
        for _ in range(args.layers):
            for (k, _), w in zip(SHAPES, weights):
                F.linear(inputs[k], w)

    def attention() -> None:
        for _ in range(args.layers):
            paged_decode.paged_decode_attention(
                q, cache, meta.block_tables, meta.seq_lens, HEAD_DIM**-0.5
            )

    def back_to_back() -> None:
        gemms()
        attention()

    def two_streams() -> None:
        main_stream, other = torch.cuda.current_stream(), torch.cuda.Stream()
        other.wait_stream(main_stream)
        with torch.cuda.stream(other):
            attention()
        gemms()
        main_stream.wait_stream(other)

    times = {name: _ms(_graph(fn)) for name, fn in [("GEMMs", gemms), ("attention", attention),
             ("back to back", back_to_back), ("two streams", two_streams)]}  # fmt: skip
    flops = 2 * args.tokens * sum(k * n for k, n in SHAPES) * args.layers
    kv_bytes = 2 * args.seqs * args.context * HEADS * HEAD_DIM * cache.element_size() * args.layers
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        f"{args.layers} layers: GEMMs of {args.tokens} rows, decode attention of {args.seqs} x {args.context}"
    )
    for name, ms in times.items():
        print(f"  {name:<14} {ms:7.3f} ms")
    print(
        f"  GEMMs {flops / times['GEMMs'] / 1e9:.0f} TFLOP/s; attention {kv_bytes / times['attention'] / 1e6:.0f} GB/s"
    )
    hidden = times["back to back"] - times["two streams"]
    print(
        f"  overlap gained: {hidden:.3f} ms = {hidden / min(times['GEMMs'], times['attention']):.2f} of the shorter half"
    )


if __name__ == "__main__":
    main()
