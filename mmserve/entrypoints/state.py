"""ServerState: what every frontend (HTTP routes, gRPC servicer) shares: engine, config, names, metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserve.core.outputs import RequestOutput
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.beam_search import beam_search_steps
from mmserve.entrypoints.log_format import log_finished
from mmserve.entrypoints.metrics import Metrics
from mmserve.entrypoints.request_ids import engine_request_id
from mmserve.entrypoints.request_phases import current_phases
from mmserve.entrypoints.server_config import ServerConfig
from mmserve.entrypoints.triton.metrics import TritonCollector
from mmserve.entrypoints.triton.statistics import TritonStatistics
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mmserve.entrypoints.tracing import RequestTracer

TRITON_MODEL_NAMES = (
    "ensemble",
    "tensorrt_llm_bls",
    "tensorrt_llm",
    "preprocessing",
    "multimodal_encoders",
    "postprocessing",
)


class ServerBusy(RuntimeError):
    """Too many requests in flight: HTTP 503 with Retry-After / gRPC UNAVAILABLE."""


class ServerDraining(ServerBusy):
    """The server is shutting down: it finishes the requests in flight and takes no new ones (503 / UNAVAILABLE)."""


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    media: MediaConfig
    model_dir: str
    model_type: str  # HF config.model_type, e.g. "llava"
    metrics: Metrics = field(init=False)
    statistics: TritonStatistics = field(
        init=False
    )  # Triton's statistics extension, per model name
    in_flight: int = 0
    draining: bool = False  # set at the first SIGTERM / SIGINT (entrypoints/serve.py)
    # a client's request id (Triton's `id`) -> how to end each request running for it (an engine abort, a beam
    # search's stop), which a later request with that id and `stop` true calls (TensorRT-LLM's tensorrt_llm model)
    by_client_id: dict[str, dict[str, Callable[[], None]]] = field(default_factory=dict)
    tracer: RequestTracer | None = field(init=False, default=None)  # --otlp-traces-endpoint

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.engine.stats, self.engine.step_stats, self.model_name)
        self.statistics = TritonStatistics()
        self.metrics.registry.register(TritonCollector(self.statistics, self.engine.stats))
        if self.config.otlp_traces_endpoint is not None:  # OpenTelemetry is imported only then
            from mmserve.entrypoints.tracing import RequestTracer

            self.tracer = RequestTracer(self.config.otlp_traces_endpoint, self.model_name)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or Path(self.model_dir).name

    @property
    def model_names(self) -> list[str]:
        """The Triton model names, the served model's and its LoRA adapters' (OpenAI requests name one as model)."""
        return [*TRITON_MODEL_NAMES, self.model_name, *self.lora_names]

    @property
    def lora_names(self) -> list[str]:
        return self.engine.lora_names()

    def has_model(self, name: str) -> bool:
        return name in self.model_names

    @property
    def ready(self) -> bool:
        """Whether to take new requests: the engine runs and the server is not draining."""
        return not self.draining and self.engine.dead_error is None

    @contextlib.contextmanager
    def _slot(self):
        """One of the server's max_concurrent_requests places, for the duration of a request."""
        if self.draining:
            raise ServerDraining("the server is shutting down and takes no new requests")
        if self.in_flight >= self.config.max_concurrent_requests:
            raise ServerBusy(
                f"{self.in_flight} requests in flight (max {self.config.max_concurrent_requests})"
            )
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def generate(
        self,
        prompt: str | dict[str, Any],
        params: SamplingParams,
        request_id: str | None = None,
        client_id: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """engine.generate with the server's concurrency cap and metrics; every frontend goes through here.
        `request_id` names the engine request (a fresh uuid when None); it must be unique among running ones.
        `client_id` (the client's own id, may repeat) lets `cancel` find it. The call's phase times
        (request_phases.py) go with it: the engine takes the request now."""
        request_id = request_id or engine_request_id()
        phases = current_phases()
        if phases is not None:
            phases.mark("handed")
        with (
            self._slot(),
            self._registered(client_id, request_id, lambda: self.engine.abort(request_id)),
        ):
            stream = self.engine.generate(prompt, params, request_id, phases)
            if self.tracer is not None:
                stream = self.tracer.traced(stream, request_id, params)
            # aclosing: when our consumer goes away, the engine stream closes now and aborts the request
            async with contextlib.aclosing(stream) as stream:
                async for out in stream:
                    if out.finished:
                        self._finished(out)
                    yield out

    def _finished(self, out: RequestOutput) -> None:
        self.metrics.on_finished(out)
        if self.config.log_requests:
            log_finished(out)

    @contextlib.contextmanager
    def _registered(self, client_id: str, request_id: str, end: Callable[[], None]):
        if not client_id:
            yield
            return
        self.by_client_id.setdefault(client_id, {})[request_id] = end
        try:
            yield
        finally:
            running = self.by_client_id[client_id]
            running.pop(request_id, None)
            if not running:
                del self.by_client_id[client_id]

    def cancel(self, client_id: str) -> int:
        """End every running request the client sent under `client_id`; how many there were."""
        running = list(self.by_client_id.get(client_id, {}).values())
        for end in running:
            end()
        return len(running)

    async def beam_search(
        self,
        prompt: dict[str, Any],
        params: SamplingParams,
        width: int,
        length_penalty: float,
        stream: bool = False,
        client_id: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Beam search (engine/beam_search.py) under the same cap and metrics as generate: one request however
        many beams; the metrics count the best beam's tokens. `stream`: the running beams after each step too.
        `cancel(client_id)` ends it after the step in flight, with the beams it has (finish reason "abort")."""
        request_id, stop = engine_request_id(), asyncio.Event()
        with self._slot(), self._registered(client_id, request_id, stop.set):
            inputs = await self.engine.preprocess(prompt)
            steps = beam_search_steps(
                self.engine,
                inputs,
                params,
                width,
                length_penalty,
                request_id,
                snapshots=stream,
                stop=stop,
            )
            if self.tracer is not None:
                steps = self.tracer.traced(steps, request_id, params)
            async with contextlib.aclosing(steps) as steps:
                async for out in steps:
                    if out.finished:
                        self._finished(out)
                    yield out

    async def generate_final(
        self, prompt: str | dict[str, Any], params: SamplingParams, client_id: str = ""
    ) -> RequestOutput:
        """generate run to its final output (closing the stream, so a cancel aborts the request at once)."""
        last = None
        async with contextlib.aclosing(
            self.generate(prompt, params, client_id=client_id)
        ) as outputs:
            async for last in outputs:
                pass
        return last
