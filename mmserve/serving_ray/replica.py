"""EngineReplica: one Ray Serve replica of mmserve, its own engine and ServerState under mmserve's own HTTP app.

The replica builds what `mmserve serve` builds (entrypoints/serve.py `build_state`, http_server.build_app: Triton /
KServe REST, OpenAI, /metrics) and runs the app on each request the ingress hands it: the ASGI scope and the whole
body in, the app's ASGI messages out as a stream, with two headers added to the response start naming the replica
(`x-mmserve-replica`: Ray's replica id, `x-mmserve-replica-pid`). Routes are the app's; nothing is re-implemented."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

REPLICA_HEADER = "x-mmserve-replica"
PID_HEADER = "x-mmserve-replica-pid"

logger = logging.getLogger(__name__)


class EngineReplica:
    """The user class of the engine deployment (serving_ray/app.py wraps it in `serve.deployment`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from ray import serve

        from mmserve.core.logs import configure_logging
        from mmserve.entrypoints.http_server import build_app
        from mmserve.entrypoints.serve import build_state
        from mmserve.entrypoints.serve_args import (
            build_engine_config,
            build_media_config,
            build_server_config,
        )

        configure_logging(args.log_level, args.log_format)
        server_config = build_server_config(args)
        media = build_media_config(args)
        self.engine, self.state = build_state(args, build_engine_config(args), media, server_config)
        self.app = build_app(self.state)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.extra_headers = [
            (REPLICA_HEADER.encode(), self.replica_id.encode()),
            (PID_HEADER.encode(), str(os.getpid()).encode()),
        ]
        logger.info("replica %s (pid %d) serves %s", self.replica_id, os.getpid(), args.model)

    async def handle_http(
        self, routing_key: str | None, scope: dict[str, Any], body: bytes
    ) -> AsyncIterator[dict[str, Any]]:
        """Run the app on one request; yields its ASGI send messages. `routing_key` is for the router only. When
        the caller goes away (the stream is cancelled), the app sees http.disconnect and is cancelled."""
        del routing_key
        sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.extra_headers]}
            await sent.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await sent.put(None)

        task = asyncio.create_task(run())
        try:
            while (message := await sent.get()) is not None:
                yield message
        finally:
            gone.set()
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def metrics_text(self) -> tuple[str, str]:
        """(this replica's id, its Prometheus exposition), for the ingress's /metrics over every replica."""
        return self.replica_id, self.state.metrics.render().decode()

    async def check_health(self) -> None:
        """Ray Serve's health probe: a dead engine fails it, and Ray replaces the replica."""
        if self.state.engine.dead_error is not None:
            raise RuntimeError(f"the engine died: {self.state.engine.dead_error}")

    def __del__(self) -> None:
        state, engine = getattr(self, "state", None), getattr(self, "engine", None)
        if state is not None:
            state.engine.shutdown()
        if engine is not None:
            engine.close()
