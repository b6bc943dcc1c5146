"""Request traces over OTLP/HTTP (`--otlp-traces-endpoint`): one trace per engine request, a root span `llm_request`
with child spans preprocess, queue, vision_encode, prefill and decode. They are built once, when the request ends
(finished, aborted or failed), from the times the engine recorded (`RequestMetrics`), with explicit start and end
times: tracing adds nothing to the engine's step. A caller's W3C `traceparent` (request_ids.trace_context) makes
the root span its child. Imported only when tracing is on (`pip install mmserve[otel]`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

import mmserve
from mmserve.core.outputs import RequestMetrics, RequestOutput
from mmserve.entrypoints.request_ids import current_request_id, trace_context
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ROOT_SPAN = "llm_request"  # vLLM's name for the same span
_UNKNOWN_SERVICE = "unknown_service"


def _ns(t: float) -> int:
    return int(t * 1e9)


def phases(m: RequestMetrics, end: float) -> list[tuple[str, float, float]]:
    """(span name, start, end) of each phase the request went through, by the engine's times (wall clock). A phase
    cut short (aborted while queued, in prefill) ends at `end`; one never reached has no span."""
    out = []
    if m.preprocess_start_time is not None and m.preprocess_end_time is not None:
        out.append(("preprocess", m.preprocess_start_time, m.preprocess_end_time))
    scheduled, first = m.first_scheduled_time, m.first_token_time
    out.append(("queue", m.arrival_time, scheduled if scheduled is not None else end))
    if m.encode_start_time is not None and m.encode_end_time is not None:
        out.append(("vision_encode", m.encode_start_time, m.encode_end_time))
    if scheduled is not None:
        out.append(("prefill", scheduled, first if first is not None else end))
    if first is not None:
        out.append(("decode", first, max(first, end)))
    return out


def request_attributes(
    model: str,
    request_id: str,
    client_request_id: str | None,
    params: SamplingParams,
    out: RequestOutput | None,
) -> dict:
    """The root span's attributes: OpenTelemetry's GenAI semantic conventions where they name the value, else
    `mmserve.*`. `request_id` is the engine request's, `client_request_id` the HTTP / gRPC call's X-Request-Id."""
    attrs: dict = {
        "gen_ai.request.model": model,
        "gen_ai.response.id": request_id,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }
    if client_request_id is not None:
        attrs["mmserve.x_request_id"] = client_request_id
    if params.top_k > 0:
        attrs["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if out is None:  # failed before its first output
        return attrs
    attrs["gen_ai.usage.input_tokens"] = len(out.prompt_token_ids or [])
    attrs["gen_ai.usage.output_tokens"] = sum(len(c.token_ids) for c in out.outputs)
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason is not None]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    m = out.metrics
    if m is not None:
        attrs["gen_ai.usage.cache_read.input_tokens"] = m.num_cached_tokens
        attrs["mmserve.request.images"] = m.num_images
        attrs["mmserve.request.image_tokens"] = m.num_media_tokens
        if m.num_videos:
            attrs["mmserve.request.videos"] = m.num_videos
    return attrs


def _failure(out: RequestOutput | None, error: BaseException | None) -> str | None:
    """Why the request did not finish normally (the span's error description), or None."""
    if out is not None and out.finished:  # the consumer may close the stream after the final output
        return "aborted" if any(c.finish_reason == "abort" for c in out.outputs) else None
    if error is None:
        return "ended before it finished"
    if _went_away(error):
        return "aborted: the client went away"
    return f"{type(error).__name__}: {error}"


def _went_away(error: BaseException) -> bool:
    """The consumer closed the stream (a client disconnect) or its task was cancelled."""
    return isinstance(error, (GeneratorExit, asyncio.CancelledError))


class RequestTracer:
    """Exports one trace per request to an OTLP/HTTP endpoint through a batching span processor (the SDK's
    OTEL_BSP_* and OTEL_EXPORTER_OTLP_TRACES_* variables apply; OTEL_SERVICE_NAME, else "mmserve")."""

    def __init__(self, endpoint: str, model: str) -> None:
        resource = Resource.create({SERVICE_VERSION: mmserve.__version__})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith(_UNKNOWN_SERVICE):
            resource = resource.merge(Resource({SERVICE_NAME: "mmserve"}))
        self.provider = TracerProvider(resource=resource)  # shuts down (flushes) at exit
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("mmserve", mmserve.__version__)
        self.model = model
        self._propagator = TraceContextTextMapPropagator()
        logger.info("request traces go to %s (OTLP/HTTP)", endpoint)

    def traced(
        self,
        stream: AsyncIterator[RequestOutput],
        request_id: str,
        params: SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        """`stream`'s outputs, unchanged; when it ends (or fails, or its consumer closes it) the request's trace is
        exported. Call it in the request's task: it reads the caller's trace context now."""
        headers = trace_context()
        parent = self._propagator.extract(headers) if headers else None
        ids = (request_id, current_request_id())
        return self._follow(stream, ids, params, parent, time.time())

    async def _follow(
        self,
        stream: AsyncIterator[RequestOutput],
        ids: tuple[str, str | None],
        params: SamplingParams,
        parent: Context | None,
        started: float,
    ) -> AsyncIterator[RequestOutput]:
        out = error = None
        try:
            async with aclosing(stream):
                async for out in stream:
                    yield out
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                self.record(ids, params, parent, started, out, error)
            except Exception:  # a trace must never break the request it describes
                logger.exception("could not record the trace of request %s", ids[0])

    def record(
        self,
        ids: tuple[str, str | None],
        params: SamplingParams,
        parent: Context | None,
        started: float,
        out: RequestOutput | None,
        error: BaseException | None = None,
    ) -> None:
        """Emit the request's spans: the root from `started` to its end, a child per phase it reached. `ids`: the
        engine request's id and the call's X-Request-Id (None outside an HTTP / gRPC call)."""
        m = out.metrics if out is not None else None
        end = m.finished_time if m is not None and m.finished_time is not None else time.time()
        root = self.tracer.start_span(
            ROOT_SPAN,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=request_attributes(self.model, *ids, params, out),
            start_time=_ns(started),
        )
        inside = trace.set_span_in_context(root)
        for name, start, stop in phases(m, end) if m is not None else []:
            self.tracer.start_span(name, context=inside, start_time=_ns(start)).end(_ns(stop))
        failure = _failure(out, error)
        if failure is not None:
            if error is not None and not _went_away(error):
                root.record_exception(error)
                root.set_attribute("error.type", type(error).__name__)
            root.set_status(Status(StatusCode.ERROR, failure))
        root.end(_ns(max(end, started)))
