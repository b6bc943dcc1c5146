"""Request ids that operators can follow: the client's `X-Request-Id` (or a fresh one) names the engine request(s)
of an HTTP request or gRPC call (metadata `x-request-id`), comes back in the response's `X-Request-Id` header
(gRPC: initial metadata), and is in the log lines about the request (its 4xx reason, `--log-requests`' line).
The caller's W3C trace context (`traceparent`, `tracestate`) travels the same way, for request traces
(entrypoints/tracing.py).

`RequestIds` is a pure ASGI middleware (streams pass through untouched) that sets the id for the request's task
(a context variable; gRPC handlers: `request_context` / `enter_request`); `engine_request_id()` gives the engine
request id of the current request: the id itself for its first engine request, `<id>-1`, `<id>-2`, ... for the
others (a Triton batch's items, beams, a gRPC stream's requests; OpenAI names its own `<response id>-<choice>`).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable, Iterator
from contextvars import ContextVar, Token

logger = logging.getLogger("mmserve.requests")

HEADER = b"x-request-id"
MAX_LENGTH = 128
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context
# W3C: tracestate is propagated up to at least 512 characters; a longer header (or traceparent) is dropped
MAX_TRACE_HEADER = 512
_current: ContextVar[list | None] = ContextVar("mmserve_request_id", default=None)
_trace: ContextVar[dict[str, str] | None] = ContextVar("mmserve_trace_context", default=None)


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


def trace_context() -> dict[str, str] | None:
    """The current request's W3C trace context headers ({"traceparent": ..., "tracestate": ...}), if it sent one."""
    return _trace.get()


def trace_headers(pairs: Iterable[tuple[str, str]]) -> dict[str, str] | None:
    """The W3C trace context among (lower-case name, value) header / metadata pairs (None without traceparent)."""
    found = {k: v for k, v in pairs if k in TRACE_HEADERS and len(v) <= MAX_TRACE_HEADER}
    return found if "traceparent" in found else None


def caller(metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[str, dict[str, str] | None]:
    """A gRPC call's `x-request-id` ("" without one) and W3C trace context, from its invocation metadata."""
    pairs = [(k, v) for k, v in metadata or () if isinstance(v, str)]  # `-bin` keys carry bytes
    return dict(pairs).get(HEADER.decode(), ""), trace_headers(pairs)


def usable_request_id(given: str) -> str:
    """`given` when it is a usable request id (printable ASCII without spaces, at most 128 characters), else a fresh
    one."""
    return given if _valid(given) else uuid.uuid4().hex


def enter_request(
    given: str, trace: dict[str, str] | None = None
) -> tuple[str, tuple[Token, Token]]:
    """Make `given` (when usable, else a fresh id) the current context's request id and `trace` its caller's trace
    context; returns (the id, what `leave_request` takes). A gRPC stream's reader calls it once and leaves it:
    the requests it starts share the id's numbering."""
    request_id = usable_request_id(given)
    return request_id, (_current.set([request_id, 0]), _trace.set(trace))


def leave_request(tokens: tuple[Token, Token]) -> None:
    _current.reset(tokens[0])
    _trace.reset(tokens[1])


@contextlib.contextmanager
def request_context(given: str, trace: dict[str, str] | None = None) -> Iterator[str]:
    """enter_request for the body of the `with`; yields the request id."""
    request_id, tokens = enter_request(given, trace)
    try:
        yield request_id
    finally:
        leave_request(tokens)


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
    replaced) or make one; return it in the response headers. Keep its `traceparent` / `tracestate` for the trace."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = [(k.lower().decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        given = dict(headers).get(HEADER.decode(), "")
        request_id, tokens = enter_request(given, trace_headers(headers))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            leave_request(tokens)
