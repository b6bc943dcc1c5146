"""Request traces against a real OTLP/HTTP receiver on 127.0.0.1 and a real `mmserve serve --otlp-traces-endpoint`:
one trace per request (root `llm_request`, children preprocess / queue / vision_encode / prefill / decode) in the
caller's trace (`traceparent` over Triton HTTP, OpenAI and gRPC metadata), with the response's token counts and
times; aborted and failed requests end in error; gRPC honours `x-request-id`. Without the flag no tracing code
loads; with it but without the packages, `serve` stops with a usage error."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from mmserve.testing import image_to_data_uri, make_test_image
from tests.server.conftest import serve_with, start_server
from tests.server.otlp_receiver import KIND_SERVER, STATUS_ERROR, STATUS_UNSET, OtlpReceiver

PHASES = ["preprocess", "queue", "vision_encode", "prefill", "decode"]
SERVICE = "mmserve-tracing-test"
PICTURE = image_to_data_uri(make_test_image(7))


def _traceparent(trace_id: str, parent_id: str) -> str:
    return f"00-{trace_id}-{parent_id}-01"


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def traced_server(tiny_llava_dir, tmp_path_factory, receiver):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: spans leave the server at once
        mp.setenv("OTEL_SERVICE_NAME", SERVICE)
        logs = tmp_path_factory.mktemp("tracing")
        with start_server(tiny_llava_dir, logs, "--otlp-traces-endpoint", receiver.url) as s:
            yield s


def _check_phases(root, children: dict, expected: list[str]) -> None:
    """Children in the root's trace and time window, each start <= end, in request order."""
    assert sorted(children) == sorted(expected)
    for span in children.values():
        assert span.trace_id == root.trace_id
        assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns, span
    c = children
    if "preprocess" in c:
        assert c["preprocess"].end_ns <= c["queue"].start_ns
    if "prefill" in c:
        assert c["queue"].end_ns == c["prefill"].start_ns
    if "vision_encode" in c:
        assert c["prefill"].start_ns <= c["vision_encode"].start_ns
        assert c["vision_encode"].end_ns <= c["prefill"].end_ns
    if "decode" in c:
        assert c["prefill"].end_ns == c["decode"].start_ns


def _infer_input(name: str, datatype: str, value) -> dict:
    return {"name": name, "datatype": datatype, "shape": [1, 1], "data": [value]}


def test_a_triton_request_with_a_picture_is_traced_in_the_callers_trace(traced_server, receiver):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    times = [
        "arrival_time_ns",
        "first_scheduled_time_ns",
        "first_token_time_ns",
        "last_token_time_ns",
    ]
    r = httpx.post(
        f"{traced_server.http_url}/v2/models/tensorrt_llm_bls/infer",
        json={
            "inputs": [
                _infer_input("text_input", "BYTES", "USER: <image>\nWhat is this? ASSISTANT:"),
                _infer_input("image_url_input", "BYTES", PICTURE),
                _infer_input("max_tokens", "INT32", 4),
                _infer_input("min_tokens", "INT32", 4),
                _infer_input("temperature", "FP32", 0.0),
                _infer_input("return_perf_metrics", "BOOL", True),
            ],
            "outputs": [{"name": n} for n in ["text_output", *times]],
        },
        headers={"traceparent": _traceparent(trace_id, parent_id), "X-Request-Id": "triton-1"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    ns = {o["name"]: o["data"][0] for o in r.json()["outputs"] if o["name"] in times}
    root, children = receiver.request_trace("triton-1")
    assert root.attributes["mmserve.x_request_id"] == "triton-1"
    assert (root.name, root.kind, root.trace_id, root.parent_id) == (
        "llm_request",
        KIND_SERVER,
        trace_id,
        parent_id,
    )
    assert root.status_code == STATUS_UNSET and root.resource["service.name"] == SERVICE
    _check_phases(root, children, PHASES)
    # the spans' times are the ones the response reports (both int(time * 1e9) of the engine's times)
    assert children["queue"].start_ns == ns["arrival_time_ns"]
    assert children["prefill"].start_ns == ns["first_scheduled_time_ns"]
    assert children["decode"].start_ns == ns["first_token_time_ns"]
    assert children["decode"].end_ns == ns["last_token_time_ns"] == root.end_ns
    a = root.attributes
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.response.finish_reasons"] == [
        "length"
    ]
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.0
    assert a["mmserve.request.images"] == 1
    assert 0 < a["mmserve.request.image_tokens"] < a["gen_ai.usage.input_tokens"]
    assert a["gen_ai.request.model"] == traced_server.model_dir.rstrip("/").split("/")[-1]


def test_an_openai_requests_span_counts_what_its_usage_says(traced_server, receiver):
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    r = httpx.post(
        f"{traced_server.http_url}/v1/chat/completions",
        json={
            "model": "ensemble",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": PICTURE}},
                        {"type": "text", "text": "Describe it."},
                    ],
                }
            ],
            "max_tokens": 3,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
        },
        headers={
            "traceparent": _traceparent(trace_id, "b7ad6b7169203331"),
            "X-Request-Id": "openai-1",
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    root, children = receiver.request_trace("openai-1", key="mmserve.x_request_id")
    assert root.trace_id == trace_id and root.parent_id == "b7ad6b7169203331"
    a = root.attributes
    assert a["gen_ai.response.id"] == f"{r.json()['id']}-0"  # choice 0's engine request
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.response.finish_reasons"] == [choice["finish_reason"]]
    assert (a["gen_ai.request.top_p"], a["gen_ai.request.seed"], a["mmserve.request.images"]) == (
        0.9,
        3,
        1,
    )
    _check_phases(root, children, PHASES if usage["completion_tokens"] else PHASES[:-1])


def _grpc_request(text: str, max_tokens: int = 3) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="ensemble")
    text_input = request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    text_input.contents.bytes_contents.append(text.encode())
    tokens = request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    tokens.contents.int_contents.append(max_tokens)
    return request


def test_grpc_metadata_names_the_request_and_carries_the_trace(traced_server, receiver):
    trace_id = "a1b2c3d4e5f60718293a4b5c6d7e8f90"
    with grpc.insecure_channel(traced_server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = [
            ("traceparent", _traceparent(trace_id, "1112131415161718")),
            ("x-request-id", "grpc-1"),
        ]
        _, call = stub.ModelInfer.with_call(_grpc_request("Hello"), metadata=metadata, timeout=60)
        assert dict(call.initial_metadata())["x-request-id"] == "grpc-1"
        _, fresh = stub.ModelInfer.with_call(_grpc_request("Hi"), timeout=60)
        assert re.fullmatch(r"[0-9a-f]{32}", dict(fresh.initial_metadata())["x-request-id"])
        # a stream's requests share its id, numbered as HTTP's engine requests are
        stream_trace = "f" * 31 + "1"
        responses = stub.ModelStreamInfer(
            iter([_grpc_request("One"), _grpc_request("Two")]),
            metadata=[
                ("traceparent", _traceparent(stream_trace, "2122232425262728")),
                ("x-request-id", "grpc-stream"),
            ],
            timeout=60,
        )
        assert all(not r.error_message for r in responses)
        assert dict(responses.initial_metadata())["x-request-id"] == "grpc-stream"
    root, children = receiver.request_trace("grpc-1")
    assert root.trace_id == trace_id and root.parent_id == "1112131415161718"
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert root.attributes["mmserve.request.images"] == 0
    _check_phases(root, children, [p for p in PHASES if p != "vision_encode"])
    for rid in ("grpc-stream", "grpc-stream-1"):
        root, _ = receiver.request_trace(rid)
        assert root.trace_id == stream_trace and root.parent_id == "2122232425262728"


def test_failed_and_aborted_requests_end_their_spans_in_error(traced_server, receiver):
    bad = httpx.post(
        f"{traced_server.http_url}/v2/models/ensemble/generate",
        json={
            "text_input": "USER: <image>\nWhat? ASSISTANT:",
            "image_url_input": "data:image/png;base64,AAAA",
            "max_tokens": 4,
        },
        headers={"X-Request-Id": "bad-picture"},
        timeout=60,
    )
    assert bad.status_code == 400, bad.text
    root, children = receiver.request_trace("bad-picture")
    assert root.status_code == STATUS_ERROR and "image_url_input" in root.status_message
    assert "exception" in root.events and root.parent_id == "" and children == {}
    body = {
        "model": "ensemble",
        "prompt": "Go on",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    url = f"{traced_server.http_url}/v1/completions"
    with httpx.stream("POST", url, json=body, headers={"X-Request-Id": "gone"}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the client goes away after its first piece
    root, children = receiver.request_trace("gone", key="mmserve.x_request_id")
    assert root.status_code == STATUS_ERROR and "went away" in root.status_message
    assert root.attributes["gen_ai.usage.output_tokens"] < 480
    assert "gen_ai.response.finish_reasons" not in root.attributes
    _check_phases(root, children, [p for p in PHASES if p != "vision_encode"])


_NO_TRACING = textwrap.dedent(
    """
    import sys
    import httpx
    import mmserve.entrypoints.cli
    from tests.server.conftest import in_process_server

    with in_process_server(sys.argv[1], grpc=True) as server:
        r = httpx.post(
            server.url + "/v2/models/ensemble/generate",
            json={"text_input": "Hi", "max_tokens": 2},
            headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    # FastAPI itself imports the OpenTelemetry API; mmserve's tracing, the SDK and the exporter stay out
    print(sorted(m for m in sys.modules if m.startswith(
        ("mmserve.entrypoints.tracing", "opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto"))))
    """
)


def test_without_the_flag_no_tracing_code_is_loaded(tiny_llava_dir):
    done = subprocess.run(
        [sys.executable, "-c", _NO_TRACING, tiny_llava_dir],
        cwd=Path(__file__).parents[2],  # the repository root: `tests` imports
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


_HIDE_OTEL = """
import sys


class HideOpenTelemetrySdk:
    def find_spec(self, name, path=None, target=None):
        if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, HideOpenTelemetrySdk())
"""


def test_the_flag_without_the_packages_is_a_usage_error(tiny_llava_dir, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(_HIDE_OTEL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    done = serve_with(tiny_llava_dir, "--otlp-traces-endpoint", "http://127.0.0.1:9/v1/traces")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--otlp-traces-endpoint" in lines[0], done.stderr
    assert "pip install mmserve[otel]" in lines[0]
