"""`mmserve serve --data-parallel-size N [--ray-address ADDR]`: mmserve's engine replicas as a Ray Serve application.

Two deployments: the engine (serving_ray/replica.py; N replicas, or Ray Serve's autoscaling between min and max, each
with the GPUs of one tensor-parallel group, routed by serving_ray/router.py) and the ingress in front of it
(serving_ray/ingress.py) behind Ray's HTTP proxy on --host:--http-port, on the head node. `serve` attaches to the
cluster at --ray-address (else starts a local Ray), runs the application, blocks until SIGTERM / SIGINT, then deletes
the application (and stops the Ray it started). Every node must see the checkpoint at the same path."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from typing import Any

from mmserve.entrypoints.server_config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "mmserve"
ENGINE_DEPLOYMENT = "mmserve_engine"
INGRESS_DEPLOYMENT = "mmserve_ingress"
INGRESS_MAX_ONGOING = 100_000  # the ingress only relays: the engine replicas' caps are what limit


def parse_autoscaling(text: str | None) -> dict[str, Any] | None:
    """--ray-autoscaling-config, checked by Ray Serve's own AutoscalingConfig; ValueError naming the flag."""
    if text is None:
        return None
    from ray.serve.config import AutoscalingConfig

    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"ray_autoscaling_config must be a JSON object: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"ray_autoscaling_config must be a JSON object, got {text!r}")
    try:
        AutoscalingConfig(**config)
    except Exception as exc:  # pydantic's ValidationError, with every field it refuses
        raise ValueError(f"ray_autoscaling_config: {exc}") from None
    return config


def gpus_per_replica(args: argparse.Namespace, cluster_gpus: float) -> int:
    """A replica's GPUs: its tensor-parallel group's on CUDA, none on CPU ('auto': CUDA when the cluster has GPUs)."""
    device = str(args.device)
    if device == "cpu" or (device == "auto" and cluster_gpus <= 0):
        return 0
    return args.tensor_parallel_size


def check_args(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
    if (args.nnodes or 1) > 1:
        raise ValueError(
            "data_parallel_size: replicas on Ray Serve span one node each; --nnodes > 1 is not supported "
            "with --data-parallel-size / --ray-address"
        )


def build_application(args: argparse.Namespace, server_config: ServerConfig, num_gpus: int):
    """The Ray Serve application: the ingress bound to the engine deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mmserve.serving_ray.ingress import Ingress
    from mmserve.serving_ray.replica import EngineReplica
    from mmserve.serving_ray.router import AffinityRouter

    autoscaling = parse_autoscaling(args.ray_autoscaling_config)
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=None if autoscaling else args.data_parallel_size,
        autoscaling_config=autoscaling,
        ray_actor_options={"num_gpus": num_gpus, "num_cpus": 1},
        max_ongoing_requests=server_config.max_concurrent_requests,
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter),
        health_check_period_s=2,
        health_check_timeout_s=30,
        graceful_shutdown_timeout_s=server_config.exit_timeout_s,
    )
    ingress = serve.deployment(
        Ingress,
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
    )
    return ingress.bind(engine.bind(args), server_config.max_request_bytes)


async def serve_on_ray(args: argparse.Namespace, server_config: ServerConfig) -> None:
    """Deploy, wait for a signal, take the application down. ValueError: a bad flag (before anything starts)."""
    check_args(args)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError(
            "data_parallel_size > 1 / --ray-address / --ray-autoscaling-config serve through Ray Serve: "
            "pip install mmserve[ray]"
        ) from None
    autoscaling = parse_autoscaling(
        args.ray_autoscaling_config
    )  # a bad value stops before Ray starts
    if autoscaling and args.data_parallel_size > 1:
        logger.warning(
            "--ray-autoscaling-config sets the replica count (%s to %s); --data-parallel-size %d is not used",
            autoscaling.get("min_replicas", 1),
            autoscaling.get("max_replicas", 1),
            args.data_parallel_size,
        )
    if server_config.grpc_port >= 0:
        logger.warning(
            "replicas on Ray Serve serve HTTP only (Triton/KServe REST, OpenAI, /metrics); no KServe gRPC "
            "server on --grpc-port %d (docs/deploy.md, 'Replicas on Ray Serve')",
            server_config.grpc_port,
        )
    started_ray = not args.ray_address
    ray.init(address=args.ray_address or None, log_to_driver=True)
    try:
        num_gpus = gpus_per_replica(args, ray.cluster_resources().get("GPU", 0))
        app = build_application(args, server_config, num_gpus)
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": server_config.host, "port": server_config.http_port},
        )
        await asyncio.to_thread(serve.run, app, name=APP_NAME, route_prefix="/")
        from mmserve.entrypoints.serve import example_request

        logger.info(
            "Ray Serve: %s engine replica(s) behind HTTP %s:%d",
            (
                f"{autoscaling.get('min_replicas', 1)} to {autoscaling.get('max_replicas', 1)} autoscaled"
                if autoscaling
                else args.data_parallel_size
            ),
            server_config.host,
            server_config.http_port,
        )
        logger.info("%s", example_request(server_config.host, server_config.http_port))
        await _until_signal()
        logger.info("deleting the Ray Serve application %s", APP_NAME)
        await asyncio.to_thread(serve.delete, APP_NAME)
    finally:
        if started_ray:
            serve.shutdown()
        ray.shutdown()


async def _until_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
