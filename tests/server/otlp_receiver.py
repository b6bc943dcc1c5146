"""A real OTLP/HTTP trace receiver on 127.0.0.1 for the tracing tests: it takes POST /v1/traces, decodes the protobuf
`ExportTraceServiceRequest` with opentelemetry-proto's classes and keeps every span as a plain `ReceivedSpan`."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

STATUS_UNSET, STATUS_ERROR = 0, 2  # opentelemetry.proto.trace.v1.Status.StatusCode
KIND_SERVER = 2  # Span.SpanKind.SPAN_KIND_SERVER


def _value(v: AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    status_code: int
    status_message: str
    events: list[str]
    resource: dict = field(default_factory=dict)


class OtlpReceiver:
    """Collects spans in `spans` (thread-safe); `url` is the endpoint to give `--otlp-traces-endpoint`."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.paths.append(self.path)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _take(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            status_code=s.status.code,
                            status_message=s.status.message,
                            events=[e.name for e in s.events],
                            resource=resource,
                        )
                    )
        with self._lock:
            self.spans.extend(got)

    def request_trace(
        self, request_id: str, key: str = "gen_ai.response.id", timeout: float = 30.0
    ) -> tuple[ReceivedSpan, dict[str, ReceivedSpan]]:
        """The root span whose attribute `key` is `request_id` (by default: the engine request's id) and its
        children by name, once they arrived."""
        deadline = time.time() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            roots = [s for s in spans if s.attributes.get(key) == request_id]
            if roots:
                assert len(roots) == 1, roots
                root = roots[0]
                children = [s for s in spans if s.parent_id == root.span_id]
                assert len({c.name for c in children}) == len(children), children
                return root, {c.name: c for c in children}
            assert time.time() < deadline, f"no span of request {request_id} in {timeout}s"
            time.sleep(0.05)
