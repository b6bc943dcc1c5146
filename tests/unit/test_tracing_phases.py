"""The spans a request's times make (entrypoints/tracing.phases) when it ends early, and the caller's trace context
as RequestIds and gRPC metadata hand it on (request_ids.trace_context, caller)."""

from __future__ import annotations

import asyncio

from mmserve.core.outputs import RequestMetrics
from mmserve.entrypoints.request_ids import RequestIds, caller, trace_context
from mmserve.entrypoints.tracing import phases

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_request_aborted_in_the_queue_has_no_prefill_or_decode_span():
    m = RequestMetrics(10.0, preprocess_start_time=9.0, preprocess_end_time=9.5)
    assert phases(m, end=12.0) == [("preprocess", 9.0, 9.5), ("queue", 10.0, 12.0)]


def test_a_request_failed_in_prefill_ends_its_prefill_span_at_the_failure():
    m = RequestMetrics(
        10.0, first_scheduled_time=11.0, encode_start_time=11.1, encode_end_time=11.2
    )
    assert phases(m, end=13.0) == [
        ("queue", 10.0, 11.0),
        ("vision_encode", 11.1, 11.2),
        ("prefill", 11.0, 13.0),
    ]


def test_a_finished_request_has_every_phase_in_order():
    m = RequestMetrics(10.0, 11.0, 12.0, 14.0, preprocess_start_time=9.0, preprocess_end_time=10.0)
    names = [name for name, _, _ in phases(m, end=14.0)]
    assert names == ["preprocess", "queue", "prefill", "decode"]
    assert phases(m, end=14.0)[-1] == ("decode", 12.0, 14.0)


def _seen_trace(headers: list[tuple[bytes, bytes]]) -> dict | None:
    seen = []

    async def app(scope, receive, send) -> None:
        seen.append(trace_context())
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message) -> None:
        pass

    asyncio.run(RequestIds(app)({"type": "http", "headers": headers}, None, send))
    return seen[0]


def test_the_http_callers_trace_context_reaches_the_request_and_is_reset_after():
    got = _seen_trace([(b"traceparent", TRACEPARENT.encode()), (b"tracestate", b"k=v")])
    assert got == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert trace_context() is None
    assert _seen_trace([(b"tracestate", b"k=v")]) is None  # tracestate without traceparent
    assert _seen_trace([(b"traceparent", b"0" * 600)]) is None  # too long to be one


def test_grpc_metadata_gives_the_request_id_and_trace_context():
    metadata = [("x-request-id", "abc"), ("traceparent", TRACEPARENT), ("blob-bin", b"\x00")]
    assert caller(metadata) == ("abc", {"traceparent": TRACEPARENT})
    assert caller(None) == ("", None)
