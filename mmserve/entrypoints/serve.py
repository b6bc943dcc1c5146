"""`mmserve serve`: the engine, the HTTP app (Triton/KServe and OpenAI routes) on uvicorn and the KServe gRPC
server, over one ServerState; and the garbage-collector settling of a server process."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import NoReturn

from mmserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger(__name__)


def example_request(host: str, port: int, scheme: str = "http") -> str:
    """The startup message: a generate request to try."""
    return (
        "Ready. Try:\n"
        f"  curl -s -X POST {scheme}://{host}:{port}/v2/models/ensemble/generate -d "
        '\'{"text_input": "USER: <image>\\nWhat is in this picture? ASSISTANT:", '
        '"image_url_input": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC", '
        '"max_tokens": 16}\'\n'
    )


def check_ports_free(config: ServerConfig) -> None:
    """ValueError naming the flag when the HTTP or gRPC port is taken (before minutes of model loading)."""
    for flag, port in [("--http-port", config.http_port), ("--grpc-port", config.grpc_port)]:
        if port <= 0:  # 0: the OS picks one; -1: no gRPC server
            continue
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            try:
                sock.bind((config.host, port))
            except OSError as exc:
                raise ValueError(
                    f"{flag} {port}: cannot listen on {config.host}:{port} ({exc.strerror})"
                ) from None


def usage_error(message: str) -> NoReturn:
    """Stop `serve` with one line and argparse's usage status, 2."""
    print(f"mmserve serve: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


GC_GEN0_THRESHOLD = 20_000  # Python's default is 700


def settle_garbage_collector() -> None:
    """For a server process, once its engine is built: what exists now (model, tokenizer, graphs, ~400k objects)
    lives until exit, so it is moved out of the collector's sight (gc.freeze), and the first generation's
    threshold is raised: a decode step at 128 streamed requests allocates ~770 containers, which with the default
    set off a collection nearly every step (100-270 us each) and a full one walking everything every few hundred
    steps (~220 ms: a stall for every request), measured on CPU with the tiny model."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def build_state(args: argparse.Namespace, engine_config, media, server_config: ServerConfig):
    """The engine (with --lora-modules) and the ServerState over it, the collector settled: (engine, state)."""
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.cache_caps import caps_line
    from mmserve.engine.engine import Engine
    from mmserve.entrypoints.state import ServerState

    engine = Engine(engine_config, media)
    for spec in args.lora_modules:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules: {spec!r} is not NAME=PATH")
        engine.add_lora(name, path)
    logging.getLogger("mmserve.serve").info(caps_line(engine))  # what fills, up to where
    state = ServerState(
        AsyncEngine(engine), server_config, media, args.model, engine.model_info.family.name
    )
    settle_garbage_collector()
    return engine, state


async def serve(args: argparse.Namespace) -> None:
    """`mmserve serve`: load the engine, serve HTTP (and gRPC) until a signal, drain (entrypoints/drain.py), then
    shut the engine down."""
    import uvicorn

    from mmserve.distributed.launch import apply_launcher_env
    from mmserve.entrypoints.drain import DrainingServer
    from mmserve.entrypoints.serve_args import (  # the config dataclasses import torch: not for the CLI
        build_engine_config,
        build_media_config,
        build_server_config,
        explain,
    )

    if args.model is None:
        from mmserve.testing import default_model_dir

        args.model = str(default_model_dir())
        logger.info("serving the embedded demo model at %s", args.model)
    from mmserve.models.hub import CheckpointError, check_servable, is_hub_id, resolve_checkpoint

    try:  # a bad or taken port, restriction or limit: a usage error before the model loads
        apply_launcher_env(args, os.environ)  # torchrun's / LeaderWorkerSet's layout, under flags
        media = build_media_config(args)
        server_config = build_server_config(args)
        if not args.node_rank:  # a worker node serves nothing
            check_ports_free(server_config)
    except ValueError as exc:
        usage_error(explain(exc, args))
    try:
        model_dir = resolve_checkpoint(args.model, args.revision, args.download_dir)
        check_servable(model_dir)
    except CheckpointError as exc:
        usage_error(str(exc))
    if is_hub_id(args.model):  # served under its hub ID, as vLLM names it
        server_config.served_model_name = server_config.served_model_name or args.model
    args.model = model_dir
    try:
        engine_config = build_engine_config(args)
    except ValueError as exc:  # an engine setting: a usage error before the model loads
        usage_error(explain(exc, args))
    if engine_config.model.node_rank:  # a worker node of multi-node tensor parallelism: headless
        from mmserve.worker.node_workers import run_worker_node

        try:
            raise SystemExit(run_worker_node(engine_config))
        except ValueError as exc:
            usage_error(explain(exc, args))
    if (
        args.data_parallel_size > 1 or args.ray_address or args.ray_autoscaling_config
    ):  # Ray Serve replicas
        from mmserve.serving_ray.launch import serve_on_ray

        try:
            return await serve_on_ray(args, server_config)
        except ValueError as exc:
            usage_error(explain(exc, args))
    engine, state = build_state(args, engine_config, media, server_config)
    from mmserve.entrypoints.http_server import build_app

    app = build_app(state)
    grpc_server = None
    if server_config.grpc_port >= 0:
        from mmserve.entrypoints.triton.grpc_server import start_grpc_server

        grpc_server, port = await start_grpc_server(
            state, server_config.host, server_config.grpc_port
        )
        logger.info("gRPC listening on %s:%d", server_config.host, port)
    config = uvicorn.Config(
        app,
        host=server_config.host,
        port=server_config.http_port,
        log_level=args.log_level,
        log_config=None,  # uvicorn's loggers go through the server's one format (core/logs.py)
        # the same event loop and HTTP parser wherever it runs (ray[serve] installs uvloop / httptools, which
        # uvicorn would otherwise pick on its own): what the tests and benchmarks ran is what the image runs
        loop="asyncio",
        http="h11",
        timeout_graceful_shutdown=5,  # after the drain: what is left is idle keep-alive connections
        ssl_certfile=server_config.ssl_certfile,
        ssl_keyfile=server_config.ssl_keyfile,
    )
    server = DrainingServer(config, state, server_config.exit_timeout_s)
    scheme = "HTTPS" if server_config.ssl_certfile else "HTTP"
    logger.info("%s listening on %s:%d", scheme, server_config.host, server_config.http_port)
    logger.info("%s", example_request(server_config.host, server_config.http_port, scheme.lower()))
    try:
        await server.serve()
    finally:
        if grpc_server is not None:
            await grpc_server.stop(grace=2)
        state.engine.shutdown()
        engine.close()
