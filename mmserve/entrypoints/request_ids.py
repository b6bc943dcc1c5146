"""Request ids that operators can follow: the client's `X-Request-Id` (or a fresh one) names the engine request(s)
of an HTTP request, comes back in the response's `X-Request-Id` header, and is in the log lines about the request
(its 4xx reason, `--log-requests`' line).

`RequestIds` is a pure ASGI middleware (streams pass through untouched) that sets the id for the request's task
(a context variable); `engine_request_id()` gives the engine request id of the current HTTP request: the id itself
for its first engine request, `<id>-1`, `<id>-2`, ... for the others (OpenAI `n`, beams).
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar

logger = logging.getLogger("mmserve.requests")

HEADER = b"x-request-id"
MAX_LENGTH = 128
_current: ContextVar[list | None] = ContextVar("mmserve_request_id", default=None)


def _valid(value: str) -> bool:
    return (
        0 < len(value) <= MAX_LENGTH
        and value.isprintable()
        and value.isascii()
        and " " not in value
    )


def current_request_id() -> str | None:
    """The id of the HTTP request being served in this task, if any."""
    state = _current.get()
    return state[0] if state is not None else None


def engine_request_id() -> str:
    """The next engine request id of the current HTTP request (outside one: a fresh uuid)."""
    state = _current.get()
    if state is None:
        return uuid.uuid4().hex
    base, count = state[0], state[1]
    state[1] += 1
    return base if count == 0 else f"{base}-{count}"


def log_client_error(status: int, message: str) -> None:
    """A refused request's reason, with its id: what an operator looks for when a client says "400"."""
    logger.info("%d %s (request %s)", status, message, current_request_id() or "-")


class RequestIds:
    """Honour a client's `X-Request-Id` (printable ASCII without spaces, at most 128 characters; another value is
    replaced) or make one; return it in the response headers."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER, b"").decode("latin-1")
        request_id = given if _valid(given) else uuid.uuid4().hex
        token = _current.set([request_id, 0])

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _current.reset(token)
