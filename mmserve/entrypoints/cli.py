"""`mmserve` command line: serve | client | demo-model | bench | quantize | models | collect-env; `--version`. `serve`'s
flags (entrypoints/serve_args.py) are parsed only for `serve`: they come from the configuration dataclasses, whose
module needs torch."""

from __future__ import annotations

import argparse
import asyncio
import sys

from mmserve.core.logs import configure_logging


def _demo_model(args: argparse.Namespace) -> None:
    from mmserve.testing import FAMILIES, make_checkpoint

    kw = {"seed": args.seed}
    if args.preset:
        kw["preset"] = args.preset
    path = make_checkpoint(args.family or next(iter(FAMILIES)), args.out_dir, **kw)
    print(path)


def main(argv: list[str] | None = None) -> int:
    import mmserve

    parser = argparse.ArgumentParser(prog="mmserve", description="Multimodal LLM inference server")
    parser.add_argument("--version", action="version", version=f"mmserve {mmserve.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "serve",
        help="serve a checkpoint over HTTP (Triton, KServe, OpenAI) and gRPC; `mmserve serve -h`: its flags",
        add_help=False,
    )
    demo = sub.add_parser("demo-model", help="write a random checkpoint that transformers loads")
    demo.add_argument("out_dir")
    demo.add_argument(
        "--family",
        default=None,
        help="a key of mmserve.testing.FAMILIES (default: the first, the demo model's family)",
    )
    demo.add_argument("--preset", default=None, help="size preset, e.g. tiny or llava-1.5-7b")
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser(
        "client", help="send a request like the Triton multimodal client", add_help=False
    )
    sub.add_parser("bench", help="benchmarks (latency, throughput, serve)", add_help=False)
    sub.add_parser(
        "quantize",
        help="calibrate and quantize a checkpoint (AWQ int4, SmoothQuant W8A8) for serve to load",
        add_help=False,
    )
    sub.add_parser("models", help="list supported architectures")
    sub.add_parser("collect-env", help="versions, GPUs and settings, for a bug report")
    args, rest = parser.parse_known_args(argv)
    if args.command == "client":
        from mmserve.entrypoints.client import main as client_main

        return client_main(rest)
    if args.command == "bench":
        from mmserve.bench.cli import main as bench_main

        return bench_main(rest)
    if args.command == "quantize":
        from mmserve.quantize import main as quantize_main

        configure_logging("info", "text")
        return quantize_main(rest)
    if args.command == "serve":
        from mmserve.entrypoints.serve_args import parse_serve_args

        args, rest = parse_serve_args(rest), []
        args.command = "serve"
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    configure_logging(str(getattr(args, "log_level", "info")), getattr(args, "log_format", "text"))
    if args.command == "serve":
        try:
            from mmserve.entrypoints.serve import serve

            asyncio.run(serve(args))
        except KeyboardInterrupt:
            pass
    elif args.command == "demo-model":
        try:
            _demo_model(args)
        except ValueError as exc:  # an unknown family or preset: a usage error, not a traceback
            demo.error(str(exc))
    elif args.command == "collect-env":
        from mmserve.entrypoints.collect_env import environment_report

        print(environment_report())
    elif args.command == "models":
        from mmserve.models.registry import supported_architectures

        print("\n".join(supported_architectures()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
