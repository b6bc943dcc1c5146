"""Ingress: the Ray Serve deployment behind Ray's HTTP proxy that hands each request to an engine replica.

Ray's proxy gives a deployment the ASGI scope first and streams the body on demand, so a request router behind the
proxy cannot see the pictures or the prompt. This deployment (no GPU, a fraction of a CPU) reads the body (at most
--max-request-bytes, else 413), computes its routing key (serving_ray/routing_key.py) and calls the engine
deployment's `handle_http` through a streaming DeploymentHandle with the key as first argument, which the
AffinityRouter (serving_ray/router.py) reads; the engine replica's ASGI messages are relayed as they come. A replica
that dies under a request ends it with 503 (or, when the response has started, a final error event on an event
stream), naming the replica. `/metrics` is the sum over replicas, `/metrics/replicas` each replica's with a
`replica` label (serving_ray/metrics_sum.py), both from a broadcast to every replica."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response

from mmserve.entrypoints.openai.responses import edge_error_response
from mmserve.serving_ray.metrics_sum import per_replica, summed
from mmserve.serving_ray.routing_key import PREFIX_CHARS, routing_key

logger = logging.getLogger(__name__)

# what of the proxy's ASGI scope the engine replica's app reads (the rest may hold proxy-side objects)
SCOPE_KEYS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "query_string",
    "root_path",
    "headers",
    "client",
    "server",
)
Send = Callable[[dict[str, Any]], Awaitable[None]]


class TooLarge(ValueError):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (TooLarge) past `limit` bytes, declared or sent."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise TooLarge(f"request body of {length} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class RelayedResponse(Response):
    """The engine replica's ASGI messages, sent on as they come; a replica lost mid-request ends it clearly."""

    def __init__(self, stream, path: str) -> None:
        self.stream, self.path = stream, path
        self.background = None

    async def __call__(self, scope, receive, send: Send) -> None:
        started = ended = False
        event_stream = False
        try:
            async for message in self.stream:
                if message["type"] == "http.response.start":
                    started = True
                    headers = message.get("headers", [])
                    content_type = dict(headers).get(b"content-type", b"")
                    event_stream = content_type.startswith(b"text/event-stream")
                    # Ray's proxy sets x-request-id itself (the same id the app echoes): sent once
                    headers = [(k, v) for k, v in headers if k.lower() != b"x-request-id"]
                    message = {**message, "headers": headers}
                elif message["type"] == "http.response.body":
                    ended = not message.get("more_body", False)
                await send(message)
        except Exception as exc:  # the replica died or was removed: Ray's RayActorError and kin
            reason = (str(exc).strip().splitlines() or [""])[
                0
            ]  # Ray's ActorDiedError runs on for lines
            message = (
                f"the engine replica serving this request failed: {type(exc).__name__}: {reason}"
            )
            logger.warning("%s %s", self.path, message)
            if not started:
                await edge_error_response(self.path, 503, message, "server_error")(
                    scope, receive, send
                )
            elif not ended:
                chunk = b""
                if event_stream:
                    error: dict[str, Any] = {"error": message}  # Triton's generate_stream shape
                    if self.path.startswith("/v1/"):
                        error = {"error": {"message": message, "type": "server_error", "code": 503}}
                    chunk = f"data: {json.dumps(error)}\n\n".encode()
                await send({"type": "http.response.body", "body": chunk, "more_body": False})


class Ingress:
    """The user class of the ingress deployment (serving_ray/app.py)."""

    def __init__(self, engine, max_request_bytes: int, prefix_chars: int = PREFIX_CHARS) -> None:
        self.engine = engine  # a DeploymentHandle of the engine deployment
        self.max_request_bytes = max_request_bytes
        self.prefix_chars = prefix_chars

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path in ("/metrics", "/metrics/replicas"):
            return await self.metrics(per_replica_view=path.endswith("/replicas"))
        try:
            body = await read_body(request, self.max_request_bytes)
        except TooLarge as exc:
            return edge_error_response(path, 413, str(exc))
        except ClientDisconnect:
            return Response(status_code=499)
        key = routing_key(body, self.prefix_chars) if body else None
        scope = {k: request.scope[k] for k in SCOPE_KEYS if k in request.scope}
        stream = self.engine.options(stream=True).handle_http.remote(key, scope, body)
        return RelayedResponse(stream, path)

    async def metrics(self, per_replica_view: bool) -> Response:
        response = self.engine.broadcast("metrics_text")
        results = await response.results_async(timeout_s=10, return_exceptions=True)
        texts = dict(r for r in results if not isinstance(r, BaseException))
        for r in results:
            if isinstance(r, BaseException):
                logger.warning("a replica's metrics could not be read: %s", r)
        text = per_replica(texts) if per_replica_view else summed(texts.values())
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)
