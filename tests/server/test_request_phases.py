"""`mmserve_request_phase_seconds` of a real server: every API records each phase once per request, and a request's
phases add up to no more than the time its client waited for the first response bytes."""

from __future__ import annotations

import queue
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from mmserve.bench.serve_phases import scrape_phases
from mmserve.core.outputs import PHASES
from mmserve.testing import image_to_data_uri, make_test_image

QUESTION = "What is in this picture?"


def _uri(seed: int) -> str:
    return image_to_data_uri(make_test_image(seed, (64, 48)))


def _first_bytes(server, path: str, body: dict) -> float:
    """Seconds from sending to the first body bytes after the response head (a stream's first event)."""
    start = time.perf_counter()
    with httpx.stream("POST", f"{server.http_url}{path}", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        first = None
        for chunk in resp.iter_raw():
            if chunk and first is None:
                first = time.perf_counter()
    return first - start


def _triton(stream: bool):
    def send(server, seed: int) -> float:
        body = {"text_input": QUESTION, "image_url_input": _uri(seed), "max_tokens": 4}
        if stream:
            body["stream"] = True
        path = "/v2/models/ensemble/" + ("generate_stream" if stream else "generate")
        return _first_bytes(server, path, body)

    return send


def _kserve_http(server, seed: int) -> float:
    inputs = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [QUESTION]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [4]},
        {"name": "image_url_input", "datatype": "BYTES", "shape": [1, 1], "data": [_uri(seed)]},
    ]
    return _first_bytes(server, "/v2/models/ensemble/infer", {"inputs": inputs})


def _grpc_inputs(seed: int, stream: bool) -> list[grpcclient.InferInput]:
    arrays = {
        "text_input": np.array([[QUESTION.encode()]], dtype=np.object_),
        "max_tokens": np.array([[4]], dtype=np.int32),
        "image_url_input": np.array([[_uri(seed).encode()]], dtype=np.object_),
        "stream": np.array([[stream]]),
    }
    out = []
    for name, arr in arrays.items():
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def _grpc_infer(server, seed: int) -> float:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = _grpc_inputs(seed, stream=False)
    start = time.perf_counter()
    client.infer("ensemble", inputs)
    return time.perf_counter() - start


def _grpc_stream(server, seed: int) -> float:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    arrivals: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: arrivals.put((time.perf_counter(), error)))
    start = time.perf_counter()
    client.async_stream_infer("ensemble", _grpc_inputs(seed, stream=True))
    client.stop_stream()
    first, error = arrivals.get(timeout=60)
    assert error is None, error
    return first - start


def _openai(path: str, stream: bool):
    def send(server, seed: int) -> float:
        content = [{"type": "image_url", "image_url": {"url": _uri(seed)}}]
        if path.endswith("chat/completions"):
            body = {
                "messages": [
                    {"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}
                ]
            }
        else:
            body = {"prompt": f"USER: {QUESTION} ({seed}) ASSISTANT:"}  # completions take text only
        body |= {"model": "ensemble", "max_tokens": 4, "temperature": 0, "stream": stream}
        return _first_bytes(server, path, body)

    return send


SENDERS = {
    "triton_generate": _triton(stream=False),
    "triton_generate_stream": _triton(stream=True),
    "kserve_http_infer": _kserve_http,
    "kserve_grpc_infer": _grpc_infer,
    "kserve_grpc_stream_infer": _grpc_stream,
    "openai_chat": _openai("/v1/chat/completions", stream=False),
    "openai_chat_stream": _openai("/v1/chat/completions", stream=True),
    "openai_completions": _openai("/v1/completions", stream=False),
    "openai_completions_stream": _openai("/v1/completions", stream=True),
}


@pytest.mark.parametrize("api", list(SENDERS))
def test_each_phase_is_recorded_once_per_request_within_the_clients_wait(server, api):
    metrics = f"{server.http_url}/metrics"
    for k in range(2):
        before = scrape_phases(metrics)
        waited = SENDERS[api](server, seed=100 * list(SENDERS).index(api) + k)
        after = scrape_phases(metrics)
        seconds = 0.0
        for phase in PHASES:
            count_before = before.get(phase, {}).get("count", 0.0)
            assert after[phase]["count"] == count_before + 1, (api, phase)
            took = after[phase]["sum"] - before.get(phase, {}).get("sum", 0.0)
            assert took >= 0.0, (api, phase)
            seconds += took
        # the server's phases run between the client's send and its first response bytes
        assert 0.0 < seconds <= waited, (api, seconds, waited)


def test_requests_that_fail_before_the_engine_record_no_phase(server):
    metrics = f"{server.http_url}/metrics"
    before = scrape_phases(metrics)
    bad = {"text_input": QUESTION, "image_url_input": "data:image/png;base64,AAAA", "max_tokens": 4}
    resp = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=bad, timeout=60)
    assert resp.status_code == 400
    assert httpx.get(f"{server.http_url}/v2/health/ready", timeout=10).status_code == 200
    after = scrape_phases(metrics)
    for phase in PHASES:
        assert after.get(phase, {}).get("count", 0.0) == before.get(phase, {}).get("count", 0.0)
