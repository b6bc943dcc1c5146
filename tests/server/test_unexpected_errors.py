"""A fault of the server's own (an exception no handler expects, injected here by monkeypatching the code a route
runs) still ends in a well-formed error in the API's own shape, and the client's connection keeps serving: HTTP
routes (OpenAI error object, Triton {"error": ...}), SSE streams (an error event, then OpenAI's [DONE]) and gRPC
(INTERNAL naming the fault; Triton's in-band error_message on a stream)."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve.entrypoints.openai import api as openai_api
from mmserve.entrypoints.openai import tokenize as tokenize_api
from mmserve.entrypoints.triton import grpc_server
from mmserve.entrypoints.triton import http as triton_http
from tests.server.conftest import in_process_server
from tests.server.test_hostile_inputs import KeepAlive

GOOD = {"text_input": "Is this fine?", "max_tokens": 4, "temperature": 0}


def _boom(*args, **kwargs):
    raise RuntimeError("injected fault")


@pytest.fixture(scope="module")
def urls(tiny_llava_dir):
    with in_process_server(tiny_llava_dir, grpc=True) as server:
        yield server.url, server.grpc_url


@pytest.fixture
def conn(urls):
    keep = KeepAlive(urls[0])
    yield keep
    keep.close()


def _model(conn: KeepAlive) -> str:
    conn.conn.request("GET", "/v1/models")
    return json.loads(conn.conn.getresponse().read())["data"][0]["id"]


def _openai_body(conn: KeepAlive, **extra) -> dict:
    return {
        "model": _model(conn),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **extra,
    }


def _after_fault_a_good_request_works(conn: KeepAlive) -> None:
    status, text = conn.post("/v2/models/ensemble/generate", GOOD)
    assert status == 200 and json.loads(text)["text_output"], text


# ---- HTTP routes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, module, name",
    [
        ("/v1/chat/completions", openai_api, "chat_prompt"),
        ("/v1/completions", openai_api, "completion_prompt"),
        ("/tokenize", tokenize_api, "chat_prompt"),
        ("/v2/models/ensemble/generate", triton_http, "_generate_json"),
        ("/v2/models/ensemble/infer", triton_http, "_infer_response"),
    ],
)
def test_a_route_that_raises_answers_500_in_its_shape(conn, monkeypatch, path, module, name):
    body = {
        "/v2/models/ensemble/generate": GOOD,
        "/v2/models/ensemble/infer": {
            "inputs": [
                {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]},
                {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [2]},
            ]
        },
        "/v1/completions": {"model": _model(conn), "prompt": "hi", "max_tokens": 2},
    }.get(path) or _openai_body(conn)
    monkeypatch.setattr(module, name, _boom)
    status, text = conn.post(path, body)
    assert status == 500, text
    error = json.loads(text)["error"]
    if path.startswith(("/v1/", "/tokenize")) and isinstance(error, dict):
        assert error["type"] == "server_error" and "injected fault" in error["message"]
    else:
        assert path.startswith("/v2/") and "injected fault" in error
    monkeypatch.undo()
    _after_fault_a_good_request_works(conn)


# ---- SSE streams ---------------------------------------------------------------------------------------


def _fail_after(first_calls: int, real):
    calls = 0

    def maybe_fail(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > first_calls:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    return maybe_fail


def test_openai_stream_that_raises_ends_with_an_error_event_and_done(conn, monkeypatch):
    monkeypatch.setattr(openai_api, "chat_chunk", _fail_after(2, openai_api.chat_chunk))
    status, text = conn.post("/v1/chat/completions", _openai_body(conn, stream=True))
    assert status == 200
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["object"] for e in events[:2]] == ["chat.completion.chunk"] * 2
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    monkeypatch.undo()
    _after_fault_a_good_request_works(conn)


def test_triton_stream_that_raises_ends_with_an_error_event(conn, monkeypatch):
    monkeypatch.setattr(triton_http, "_generate_json", _fail_after(1, triton_http._generate_json))
    status, text = conn.post(
        "/v2/models/ensemble/generate_stream",
        {**GOOD, "max_tokens": 8, "min_tokens": 8, "stream": True},
    )
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert "text_output" in events[0] and "injected fault" in events[-1].get("error", ""), events
    monkeypatch.undo()
    _after_fault_a_good_request_works(conn)


# ---- gRPC ------------------------------------------------------------------------------------------------


def _grpc_inputs() -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in [
        ("text_input", np.array([["hi"]], dtype=object)),
        ("max_tokens", np.array([[3]], np.int32)),
    ]:
        inputs.append(
            grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        )
        inputs[-1].set_data_from_numpy(value)
    return inputs


def test_grpc_handlers_that_raise_end_internal_and_the_channel_serves_on(urls, monkeypatch):
    client = grpcclient.InferenceServerClient(urls[1])
    monkeypatch.setattr(grpc_server, "_response", _boom)
    with pytest.raises(InferenceServerException) as info:
        client.infer("ensemble", _grpc_inputs())
    assert info.value.status() == "StatusCode.INTERNAL" and "injected fault" in info.value.message()
    monkeypatch.setattr(grpc_server, "model_metadata", _boom)
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("ensemble")
    assert info.value.status() == "StatusCode.INTERNAL" and "injected fault" in info.value.message()
    monkeypatch.undo()
    assert client.get_model_metadata("ensemble").name == "ensemble"
    assert client.infer("ensemble", _grpc_inputs()).as_numpy("text_output").size == 1


def test_grpc_stream_fault_is_an_in_band_error_and_the_stream_serves_on(urls, monkeypatch):
    client = grpcclient.InferenceServerClient(urls[1])
    results: list = []
    done = threading.Event()

    def callback(result, error) -> None:
        results.append((result, error))
        if (
            error is not None
            or result.get_response().parameters["triton_final_response"].bool_param
        ):
            done.set()

    client.start_stream(callback)
    try:
        monkeypatch.setattr(grpc_server, "_response", _boom)
        client.async_stream_infer("ensemble", _grpc_inputs(), request_id="bad")
        assert done.wait(60)
        assert results[-1][1] is not None and "injected fault" in str(results[-1][1])
        monkeypatch.undo()
        done.clear()
        client.async_stream_infer("ensemble", _grpc_inputs(), request_id="good")
        assert done.wait(60)
        assert results[-1][1] is None and results[-1][0].get_response().id == "good"
    finally:
        client.stop_stream()
