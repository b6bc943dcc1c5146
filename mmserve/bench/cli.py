"""`mmserve bench latency | throughput | serve`: parse arguments into a config, run the bench, write the
JSON / markdown / plots. Returns 1 when a phase failed (its error is in the JSON), else 0.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any

from mmserve.bench.goodput import parse_goodput
from mmserve.bench.workload import DEFAULT_FAMILY, DEFAULT_WORK_DIR, ModelSource

WARMUP_HELP = (
    "untimed runs before any timing: every shape the timed part runs gets one at least (serve: 0 = none, "
    "for a server that an earlier run warmed up)"
)
QUANTIZATION_CHOICES = ("fp8", "int8", "int4", "int4_g128", "w8a8")  # config's (no torch here)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _rates(text: str) -> list[float]:
    return [
        math.inf if x.strip().lower() == "inf" else float(x) for x in text.split(",") if x.strip()
    ]


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _common(
    p: argparse.ArgumentParser,
    *,
    input_len: int,
    output_len: int,
    warmup: int,
    iters: int | None,
    baseline: str,
) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF checkpoint directory")
    g.add_argument(
        "--family",
        default=None,
        help=f"model family of --preset (default {DEFAULT_FAMILY}): llava | "
        "llava_next | llava_onevision | qwen2_vl | blip2",
    )
    g.add_argument(
        "--preset",
        default=None,
        help="write a random checkpoint of this shape of --family (tiny, "
        "llava-1.5-7b, qwen2-vl-7b, ...; docs/benchmarks.md lists them)",
    )
    g.add_argument(
        "--work-dir", default=DEFAULT_WORK_DIR, help="where --preset checkpoints live (reused)"
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    g.add_argument(
        "--dtype",
        default=None,
        help="float16 | bfloat16 | float32 (default float16 on cuda, else float32)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--input-len",
        type=int,
        default=input_len,
        help="text tokens per prompt, besides the image's",
    )
    w.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"tokens generated per request (default {output_len}; with --dataset: each line's own)",
    )
    p.set_defaults(default_output_len=output_len)
    w.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="side of the square images (default: the vision tower's input size, else 336)",
    )
    w.add_argument("--warmup", type=int, default=warmup, help=WARMUP_HELP)
    if iters is not None:
        w.add_argument("--iters", type=int, default=iters)
    w.add_argument("--seed", type=int, default=0)
    b = p.add_argument_group("baseline and output")
    b.add_argument(
        "--baseline",
        default=baseline,
        choices=("hf", "none"),
        help="run transformers in the same run",
    )
    b.add_argument(
        "--hf-attn", default=None, help="transformers attn_implementation (default: its default)"
    )
    b.add_argument("--out", default=None, help="write the JSON record here")
    b.add_argument("--markdown", default=None, help="append the markdown section to this file")
    b.add_argument("--plot-dir", default=None, help="write PNG plots here")


def _dataset_and_goodput(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("dataset and objectives")
    w.add_argument(
        "--dataset",
        default=None,
        metavar="FILE.jsonl",
        help="requests from a JSONL file, one per line: {prompt, images, output_len} or ShareGPT4V / "
        "LLaVA-instruct {image, conversations}; --num-requests takes the first lines (cycled if short)",
    )
    w.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="service-level objectives, e.g. ttft:300 tpot:50 e2e:2000 (any of them, space- or "
        "comma-separated): requests/s meeting all of them",
    )


def _engine_args(p: argparse.ArgumentParser, max_num_seqs: bool) -> None:
    g = p.add_argument_group("mmserve engine")
    if max_num_seqs:
        g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.9)
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="KV cache storage (fp8: e4m3, half the bytes per token)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATION_CHOICES,
        help="mmserve's decoder linear weights to e4m3 (fp8), int8 / int4 (weight-only, a scale per row), "
        "int4_g128 (group-wise, the AWQ / GPTQ kernel) or w8a8 (int8 weights and activations) at load (the "
        "transformers baseline stays as is)",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument(
        "--enforce-eager", action="store_true", help="mmserve without CUDA graphs (to compare)"
    )
    g.add_argument(
        "--tensor-parallel-size",
        "--tp-size",
        type=int,
        default=1,
        metavar="N",
        help="mmserve's language model sharded over GPUs 0..N-1 (transformers runs on one)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmserve bench", description="mmserve benchmarks, transformers baseline"
    )
    sub = parser.add_subparsers(dest="bench", required=True)

    lat = sub.add_parser(
        "latency", help="batch-size sweep: TTFT, decode ms/step and tok/s, bandwidth roofline"
    )
    _common(lat, input_len=128, output_len=32, warmup=1, iters=3, baseline="hf")
    lat.add_argument(
        "--batch-sizes", type=_ints, default=[1, 8, 32], help="comma list, e.g. 1,8,32"
    )
    lat.add_argument(
        "--prefix-caching", action="store_true", help="leave mmserve's prefix cache on"
    )
    lat.add_argument(
        "--bandwidth-mib", type=int, default=None, help="copy size for the bandwidth probe"
    )
    lat.add_argument(
        "--images-per-request",
        type=int,
        default=1,
        help="distinct pictures in each prompt (more than 1: mmserve only, with --baseline none)",
    )
    lat.add_argument(
        "--mm-encoder-tp-mode",
        default="driver",
        choices=("driver", "data"),
        help="mmserve's vision encoders under --tensor-parallel-size: on rank 0 (driver) or split over "
        "every rank (data)",
    )
    _engine_args(lat, max_num_seqs=False)

    thr = sub.add_parser(
        "throughput", help="N requests offline through LLM.generate: output tok/s, requests/s"
    )
    _common(thr, input_len=128, output_len=128, warmup=1, iters=1, baseline="hf")
    thr.add_argument("--num-requests", type=int, default=256)
    thr.add_argument("--hf-batch-size", type=int, default=32)
    thr.add_argument(
        "--same-image",
        action="store_true",
        help="one image for all requests, each with its own text (prefix- and encoder-cache hits)",
    )
    thr.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (both engines)"
    )
    thr.add_argument("--top-p", type=float, default=1.0)
    thr.add_argument("--top-k", type=int, default=0, help="0 = off")
    thr.add_argument(
        "--profile-dir",
        default=None,
        help="after the timed rounds, run one more under the torch profiler (CUDA) and write its "
        "trace and a kernel-time summary (kernels.md) here",
    )
    _dataset_and_goodput(thr)
    _engine_args(thr, max_num_seqs=True)

    srv = sub.add_parser(
        "serve", help="load generator against a running server (rate and concurrency sweeps)"
    )
    _common(srv, input_len=128, output_len=128, warmup=2, iters=None, baseline="none")
    srv.add_argument(
        "--url", required=True, help="http://127.0.0.1:8000 (HTTP) or 127.0.0.1:8001 (gRPC)"
    )
    srv.add_argument(
        "--protocol", default="triton-http", choices=("triton-http", "triton-grpc", "openai")
    )
    srv.add_argument(
        "--model-name", default=None, help="triton model (default ensemble) / openai model id"
    )
    srv.add_argument(
        "--request-rates",
        type=_rates,
        default=[1.0, 4.0, 16.0],
        help="req/s list; inf ok; '' skips",
    )
    srv.add_argument(
        "--concurrency", type=_ints, default=[1, 8, 32], help="closed-loop clients list; '' skips"
    )
    srv.add_argument("--num-requests", type=int, default=64, help="per sweep point")
    srv.add_argument(
        "--max-duration",
        type=float,
        default=120.0,
        help="seconds per point before it stops sending",
    )
    srv.add_argument("--request-timeout", type=float, default=300.0)
    srv.add_argument(
        "--same-image", action="store_true", help="one image for all requests (cache hits)"
    )
    srv.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        type=_header,
        help="sent with every request (HTTP header / gRPC metadata), e.g. for a server started with "
        "--http-restricted-api; repeatable",
    )
    srv.add_argument(
        "--label",
        default=None,
        help="the measured server's name in the results (default: the name it reports, else 'server')",
    )
    _dataset_and_goodput(srv)
    return parser


def _device_dtype(args: argparse.Namespace) -> tuple[str, str]:
    from mmserve.bench.workload import default_device, default_dtype

    device = default_device() if args.device == "auto" else args.device
    return device, args.dtype or default_dtype(device)


def _source(args: argparse.Namespace, required: bool) -> ModelSource | None:
    if not required and args.model is None and args.preset is None:
        if args.family is not None:
            raise ValueError("--family goes with --preset")
        return None
    return ModelSource(
        model=args.model, preset=args.preset, work_dir=args.work_dir, family=args.family
    )


def _build(args: argparse.Namespace) -> tuple[Callable[..., dict[str, Any]], Any]:
    """(run function, its config); ValueError for a bad setting."""
    device, dtype = _device_dtype(args)
    common = dict(
        device=device,
        dtype=dtype,
        input_len=args.input_len,
        output_len=args.output_len or args.default_output_len,
        warmup=args.warmup,
        baseline=args.baseline,
        hf_attn=args.hf_attn,
        seed=args.seed,
    )
    if args.image_size is not None and args.image_size < 1:
        raise ValueError(f"--image-size must be >= 1, got {args.image_size}")
    if args.bench == "latency":
        from mmserve.bench.latency import LatencyConfig, run_latency

        cfg = LatencyConfig(
            source=_source(args, True),
            batch_sizes=args.batch_sizes,
            iters=args.iters,
            prefix_caching=args.prefix_caching,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            block_size=args.block_size,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
            bandwidth_mib=args.bandwidth_mib,
            image_size=args.image_size,
            images_per_request=args.images_per_request,
            mm_encoder_tp_mode=args.mm_encoder_tp_mode,
            **common,
        )
        return run_latency, cfg
    if args.bench == "throughput":
        from mmserve.bench.throughput import ThroughputConfig, run_throughput

        cfg = ThroughputConfig(
            source=_source(args, True),
            num_requests=args.num_requests,
            iters=args.iters,
            hf_batch_size=args.hf_batch_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            block_size=args.block_size,
            tensor_parallel_size=args.tensor_parallel_size,
            enforce_eager=args.enforce_eager,
            image_size=args.image_size,
            same_image=args.same_image,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            profile_dir=args.profile_dir,
            dataset=args.dataset,
            output_len_fixed=args.output_len is not None,
            goodput=parse_goodput(args.goodput),
            **common,
        )
        return run_throughput, cfg
    from mmserve.bench.serve import ServeConfig, run_serve
    from mmserve.bench.workload import DEFAULT_IMAGE_SIZE, image_size_of

    source = _source(args, args.baseline == "hf")
    image_size = args.image_size or (
        image_size_of(source.resolve()) if source else DEFAULT_IMAGE_SIZE
    )
    cfg = ServeConfig(
        url=args.url,
        protocol=args.protocol,
        model_name=args.model_name,
        request_rates=args.request_rates,
        concurrencies=args.concurrency,
        num_requests=args.num_requests,
        max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout,
        image_size=image_size,
        unique_images=not args.same_image,
        source=source,
        headers=dict(args.header),
        label=args.label,
        dataset=args.dataset,
        output_len_fixed=args.output_len is not None,
        goodput=parse_goodput(args.goodput),
        **common,
    )
    return run_serve, cfg


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        run, cfg = _build(args)
    except ValueError as e:  # a bad setting: say which, no traceback
        print(f"mmserve bench {args.bench}: {e}", file=sys.stderr)
        return 2
    result = run(cfg, argv)
    from mmserve.bench.report import write_outputs

    md = write_outputs(result, args.out, args.markdown, args.plot_dir)
    print(md)
    for err in result["errors"]:
        print(err, file=sys.stderr)
    return 1 if result["errors"] else 0
