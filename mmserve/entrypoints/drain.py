"""Shutdown that lets requests in flight finish (Triton's `--exit-timeout-secs`).

At the first SIGTERM / SIGINT the server starts draining: readiness turns 503 at once (liveness stays 200), new
requests get 503 / gRPC UNAVAILABLE (`ServerState.draining`), and the requests and streams in flight run to their
end, for at most the exit timeout; then the HTTP server stops and `serve` shuts the gRPC server and the engine
down and returns, so the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from mmserve.entrypoints.state import ServerState

logger = logging.getLogger("mmserve.serve")
POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    """uvicorn's server with Triton's shutdown: drain first, stop when nothing is left in flight."""

    def __init__(self, config: uvicorn.Config, state: ServerState, exit_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.exit_timeout_s = exit_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn's own handler would stop accepting connections at once, and re-raise the signal at exit
        if self.state.draining or self._loop is None:
            logger.warning("second signal (%s): stopping now", signal.Signals(sig).name)
            self.force_exit = self.should_exit = True
            return
        self.state.draining = True
        logger.warning(
            "%s: draining (%d requests in flight, at most %.0f s); readiness is 503 and new requests "
            "are refused",
            signal.Signals(sig).name,
            self.state.in_flight,
            self.exit_timeout_s,
        )
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._wait_then_stop())

    async def _wait_then_stop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.exit_timeout_s
        while self.state.in_flight and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        if self.state.in_flight:
            logger.warning(
                "exit timeout: %d requests still in flight are cut", self.state.in_flight
            )
        else:
            logger.info("drained: no request in flight")
        self.should_exit = True
