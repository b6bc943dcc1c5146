"""Bad input, overload and disconnects on the Triton frontends: every bad request gets a 400 (404 for an
unknown model) naming the field while good requests keep completing; a full server answers 503 /
UNAVAILABLE; a client that goes away mid-request frees its KV blocks and its slot."""

from __future__ import annotations

import base64
import queue
import re
import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve.testing import image_to_data_uri, make_llava_checkpoint, make_test_image
from tests.server.conftest import start_server

GOOD = {"text_input": "Is this fine?", "max_tokens": 48, "temperature": 0}
LONG = {"text_input": "hello", "max_tokens": 6000, "min_tokens": 6000, "temperature": 0}

BAD_GENERATE = [
    ({"max_tokens": 8}, "text_input"),
    ({**GOOD, "max_tokens": "16"}, "max_tokens"),
    ({**GOOD, "max_tokens": 16.0}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": [4, 4]}, "max_tokens"),
    ({**GOOD, "temperature": -1}, "temperature"),
    ({**GOOD, "top_p": 2}, "top_p"),
    ({**GOOD, "top_k": -5}, "top_k"),
    ({**GOOD, "min_tokens": 99}, "min_tokens"),
    ({**GOOD, "seed": -1}, "seed"),
    ({**GOOD, "parameters": {"beam_width": 11}}, "beam_width"),
    ({**GOOD, "stop_words": [["a"]]}, "stop_words"),
    ({**GOOD, "decoder_text_input": "Sure,"}, "decoder_text_input"),  # LLaVA has no decoder prompt
    ({**GOOD, "image_url_input": "data:image/png;base64,@@@"}, "image_url_input"),
    (
        {
            **GOOD,
            "image_url_input": "data:image/png;base64,"
            + base64.b64encode(b"not an image").decode(),
        },
        "image_url_input",
    ),
    ({**GOOD, "image_url_input": "ftp://example.com/a.png"}, "image_url_input"),
    ({**GOOD, "video_bytes_input": [1, 2, 3]}, "video_bytes_input"),
    (
        {
            **GOOD,
            "text_input": "<image><image>two?",
            "image_url_input": image_to_data_uri(make_test_image(1)),
        },
        "text_input",
    ),
    ({**GOOD, "text_input": "word " * 700}, "text_input"),
    ({**GOOD, "parameters": "x"}, "parameters"),
    ({**GOOD, "id": 5}, "'id'"),
]


def _infer_body(**overrides) -> dict:
    inputs = [
        {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]},
        {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [4]},
    ]
    return {"inputs": inputs, **overrides}


BAD_INFER = [
    ({"inputs": []}, "inputs"),
    (
        _infer_body(
            inputs=[{"name": "text_input", "datatype": "FOO", "shape": [1, 1], "data": ["hi"]}]
        ),
        "text_input",
    ),
    (
        _infer_body(
            inputs=[{"name": "max_tokens", "datatype": "INT32", "shape": [1, 2], "data": [4]}]
        ),
        "max_tokens",
    ),
    (
        _infer_body(
            inputs=[
                {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]},
                {"name": "max_tokens", "datatype": "FP32", "shape": [1, 1], "data": [4.0]},
            ]
        ),
        "max_tokens",
    ),
    (
        _infer_body(
            inputs=[
                {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]},
                {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [4]},
                {"name": "foo", "datatype": "INT32", "shape": [1, 1], "data": [1]},
            ]
        ),
        "'foo'",
    ),
    (_infer_body(outputs=[{"name": "nope"}]), "'nope'"),
    (
        _infer_body(
            inputs=[
                {
                    "name": "text_input",
                    "datatype": "BYTES",
                    "shape": [1, 1],
                    "parameters": {"binary_data_size": 99},
                }
            ]
        ),
        "text_input",
    ),
]


def kv_usage(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(
        re.search(r"^mmserve_kv_cache_usage_ratio(?:\{[^}]*\})? (\S+)", text, re.M).group(1)
    )


def wait_kv(url: str, predicate, timeout: float = 10.0) -> float:
    """Seconds until predicate(kv usage) holds; fails after timeout."""
    start = time.time()
    while not predicate(usage := kv_usage(url)):
        assert time.time() - start < timeout, f"KV usage stuck at {usage}"
        time.sleep(0.05)
    return time.time() - start


class GoodTraffic:
    """Good requests in a loop on a thread while the test sends bad ones."""

    def __init__(self, url: str) -> None:
        self.url, self.results, self.stop = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                r = client.post(f"{self.url}/v2/models/ensemble/generate", json=GOOD)
                self.results.append((r.status_code, r.json().get("text_output")))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def test_bad_inputs_get_400_naming_the_field_while_good_requests_complete(server):
    url = server.http_url
    with GoodTraffic(url) as good, httpx.Client(timeout=60) as client:
        for body, field in BAD_GENERATE:
            for route in ("generate", "generate_stream"):
                r = client.post(f"{url}/v2/models/ensemble/{route}", json=body)
                assert r.status_code == 400 and field in r.json()["error"], (route, body, r.text)
        for body, field in BAD_INFER:
            r = client.post(f"{url}/v2/models/tensorrt_llm_bls/infer", json=body)
            assert r.status_code == 400 and field in r.json()["error"], (body, r.text)
        malformed = [(b"{", "malformed JSON"), (b"[1]", "JSON object")]
        for raw, words in malformed:
            for route in ("generate", "infer"):
                r = client.post(f"{url}/v2/models/ensemble/{route}", content=raw)
                assert r.status_code == 400 and words in r.json()["error"]
        r = client.post(
            f"{url}/v2/models/ensemble/infer",
            content=b"{}",
            headers={"Inference-Header-Content-Length": "50"},
        )
        assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"]
        for method, path in (
            ("POST", "generate"),
            ("POST", "generate_stream"),
            ("POST", "infer"),
            ("GET", "config"),
            ("GET", ""),
        ):
            r = client.request(method, f"{url}/v2/models/nope/{path}".rstrip("/"), json=GOOD)
            assert r.status_code == 404 and "nope" in r.json()["error"]
    statuses = {status for status, _ in good.results}
    assert good.results and statuses == {200} and len({text for _, text in good.results}) == 1


def test_grpc_errors_map_to_status_codes(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def call(model: str, **arrays):
        tensors = []
        for name, arr in arrays.items():
            tensors.append(
                grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            )
            tensors[-1].set_data_from_numpy(arr)
        with pytest.raises(InferenceServerException) as err:
            client.infer(model, tensors)
        return err.value

    text = np.array([[b"hi"]], dtype=object)
    err = call("ensemble", text_input=text, max_tokens=np.array([[0]], np.int32))
    assert "INVALID_ARGUMENT" in err.status() and "max_tokens" in err.message()
    err = call(
        "ensemble",
        text_input=text,
        max_tokens=np.array([[4]], np.int32),
        image_bytes_input=np.zeros((1, 1, 4, 4, 3), np.uint8),
        image_url_input=np.array([[b"x"]], dtype=object),
    )
    assert "INVALID_ARGUMENT" in err.status() and "only one of" in err.message()
    err = call("nope", text_input=text, max_tokens=np.array([[4]], np.int32))
    assert "NOT_FOUND" in err.status()


# ---- a server with one request slot and a long-context checkpoint -------------------------------------
@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    model = make_llava_checkpoint(
        tmp_path_factory.mktemp("long_llava"), preset="tiny", seed=0, max_position=8192
    )
    with start_server(
        str(model),
        tmp_path_factory.mktemp("busy-logs"),
        "--max-concurrent-requests",
        "1",
        "--kv-cache-size-gb",
        "0.05",
        "--accumulate-tokens",
    ) as handle:
        yield handle


def test_overload_gives_503_and_a_disconnected_stream_frees_kv_and_its_slot(busy_server):
    url = busy_server.http_url
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", f"{url}/v2/models/ensemble/generate_stream", json={**LONG, "stream": True}
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            assert next(line for line in lines if line.startswith("data: "))
            wait_kv(url, lambda usage: usage > 0)
            busy = client.post(f"{url}/v2/models/ensemble/generate", json=GOOD)
            assert (
                busy.status_code == 503
                and busy.headers["retry-after"]
                and "in flight" in busy.json()["error"]
            )
            grpc_client = grpcclient.InferenceServerClient(busy_server.grpc_url)
            tensors = [
                grpcclient.InferInput("text_input", [1, 1], "BYTES"),
                grpcclient.InferInput("max_tokens", [1, 1], "INT32"),
            ]
            tensors[0].set_data_from_numpy(np.array([[b"hi"]], dtype=object))
            tensors[1].set_data_from_numpy(np.array([[4]], np.int32))
            with pytest.raises(InferenceServerException) as err:
                grpc_client.infer("ensemble", tensors)
            assert "UNAVAILABLE" in err.value.status()
        assert (
            wait_kv(url, lambda usage: usage == 0, timeout=5) < 5
        )  # the 6000-token request was aborted
        assert client.post(f"{url}/v2/models/ensemble/generate", json=GOOD).status_code == 200


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(
        next(
            line.split()[-1]
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))
        )
    )


def test_beam_search_takes_a_slot_and_counts_in_the_metrics(busy_server):
    url = busy_server.http_url
    beams = {**GOOD, "beam_width": 2, "max_tokens": 4}
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST", f"{url}/v2/models/ensemble/generate_stream", json={**LONG, "stream": True}
        ) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            busy = client.post(f"{url}/v2/models/tensorrt_llm_bls/generate", json=beams)
            assert busy.status_code == 503 and "in flight" in busy.json()["error"]
        wait_kv(url, lambda usage: usage == 0, timeout=5)
        before = _metric(url, "mmserve_prompt_tokens_total")
        done = client.post(f"{url}/v2/models/tensorrt_llm_bls/generate", json=beams)
        assert done.status_code == 200 and len(done.json()["text_output"]) == 2
        assert _metric(url, "mmserve_prompt_tokens_total") > before


def test_a_non_streaming_client_that_times_out_frees_kv_and_its_slot(busy_server):
    url = busy_server.http_url
    start = time.time()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/v2/models/tensorrt_llm_bls/generate", json=LONG, timeout=0.5)
    wait_kv(url, lambda usage: usage == 0, timeout=5)
    r = httpx.post(f"{url}/v2/models/ensemble/generate", json=GOOD, timeout=60)
    assert (
        r.status_code == 200 and time.time() - start < 6
    )  # the long request would still hold the slot


def test_a_cancelled_grpc_stream_frees_kv_and_its_slot(busy_server):
    client = grpcclient.InferenceServerClient(busy_server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, arr in (
        ("text_input", np.array([[b"hello"]], dtype=object)),
        ("max_tokens", np.array([[6000]], np.int32)),
        ("min_tokens", np.array([[6000]], np.int32)),
        ("stream", np.array([[True]])),
    ):
        tensors.append(grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype)))
        tensors[-1].set_data_from_numpy(arr)
    client.async_stream_infer("ensemble", tensors)
    result, error = results.get(timeout=30)
    assert error is None and result.as_numpy("text_output") is not None
    client.stop_stream(cancel_requests=True)
    wait_kv(busy_server.http_url, lambda usage: usage == 0, timeout=5)
    assert (
        httpx.post(
            f"{busy_server.http_url}/v2/models/ensemble/generate", json=GOOD, timeout=60
        ).status_code
        == 200
    )


def test_bls_accumulate_tokens_repeats_the_text_so_far(busy_server):
    body = {
        "text_input": "hello",
        "max_tokens": 8,
        "min_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    events = {}
    for model in ("tensorrt_llm_bls", "ensemble"):
        r = httpx.post(
            f"{busy_server.http_url}/v2/models/{model}/generate_stream", json=body, timeout=60
        )
        events[model] = [
            e["text_output"]
            for e in (httpx.Response(200, content=c[6:]).json() for c in r.text.split("\n\n") if c)
        ]
    accumulated, pieces = events["tensorrt_llm_bls"], events["ensemble"]
    assert len(accumulated) >= 2 and accumulated[-1] == "".join(pieces)
    assert all(later.startswith(earlier) for earlier, later in zip(accumulated, accumulated[1:]))
