"""Per-phase timing of served requests (`mmserve_request_phase_seconds`): each HTTP request and gRPC call gets a
`PhaseTimes` (core/outputs.py) in a context variable when it starts; `ServerState.generate` marks the engine taking
it and hands it to the engine, which marks media, preprocessing, first scheduling and first token; the first
response bytes handed to the transport after the first token mark the last event and record the phases.

`RequestPhases` is a pure ASGI middleware, outermost (streams pass through untouched); gRPC handlers use
`timed_call` (a stream's request, in a task of its own: `start_timed_call`) and `bytes_out`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from mmserve.core.outputs import PhaseTimes
from mmserve.entrypoints.metrics import Metrics

_current: ContextVar[PhaseTimes | None] = ContextVar("mmserve_request_phases", default=None)


def current_phases() -> PhaseTimes | None:
    """The phase times of the HTTP request / gRPC call served in this context, if any."""
    return _current.get()


def start_timed_call() -> PhaseTimes:
    """A fresh PhaseTimes, received now, current from here on in this context (a task's own: gone with it)."""
    times = PhaseTimes()
    times.mark("received")
    _current.set(times)
    return times


@contextlib.contextmanager
def timed_call() -> Iterator[PhaseTimes]:
    """start_timed_call for the body of the `with`."""
    token = _current.set(None)
    try:
        yield start_timed_call()
    finally:
        _current.reset(token)


def bytes_out(times: PhaseTimes | None, metrics: Metrics) -> None:
    """Response bytes are handed to the transport now: the first ones after the first token end the phases."""
    if times is not None and times.reached("first_token") and not times.reached("first_byte"):
        times.mark("first_byte")
        metrics.observe_phases(times)


class RequestPhases:
    """Times each HTTP request from its start to its first response body bytes after the first token."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with timed_call() as times:

            async def timed_send(message) -> None:
                if message["type"] == "http.response.body" and message.get("body"):
                    bytes_out(times, self.metrics)
                await send(message)

            await self.app(scope, receive, timed_send)
