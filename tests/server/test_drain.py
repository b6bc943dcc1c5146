"""Shutdown as Triton's `--exit-timeout-secs`: at SIGTERM a real `mmserve serve` turns readiness 503 (liveness
200), refuses new requests (HTTP 503, gRPC UNAVAILABLE), lets the Triton, OpenAI and gRPC streams in flight run to
their end, then exits 0; the exit timeout cuts what is left; a second signal stops at once."""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mmserve.testing import make_checkpoint
from tests.server.conftest import start_server
from tests.server.test_triton_grpc import inputs

TOKENS = 1800  # long enough to be in flight for seconds (the checkpoint below has 2048 positions)
BODY = {
    "text_input": "Tell a long story.",
    "max_tokens": TOKENS,
    "min_tokens": TOKENS,
    "temperature": 0,
}


def _triton_stream(url: str, out: dict) -> None:
    events = []
    with httpx.stream(
        "POST",
        f"{url}/v2/models/ensemble/generate_stream",
        json={**BODY, "stream": True},
        timeout=120,
    ) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                out["started"].set()
    out["events"] = events


def _openai_stream(url: str, out: dict) -> None:
    body = {
        "model": "tiny_llava",
        "prompt": BODY["text_input"],
        "max_tokens": TOKENS,
        "min_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line[len("data: ") :])
                out["started"].set()
    out["data"] = data


def _grpc_inputs() -> list:
    return inputs(
        text_input=np.array([[BODY["text_input"].encode()]], dtype=object),
        max_tokens=np.array([[TOKENS]], np.int32),
        min_tokens=np.array([[TOKENS]], np.int32),
        temperature=np.array([[0.0]], np.float32),
        stream=np.array([[True]]),
    )


def _grpc_stream(url: str, out: dict) -> None:
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()

    def on_result(result, error):
        results.put((result, error))
        out["started"].set()

    client.start_stream(callback=on_result)
    client.async_stream_infer(
        "ensemble", _grpc_inputs(), outputs=[grpcclient.InferRequestedOutput("text_output")]
    )
    client.stop_stream()  # blocks until the server has answered everything
    out["results"] = [results.get() for _ in range(results.qsize())]
    client.close()


def _start(target, url: str) -> tuple[threading.Thread, dict]:
    """Run a client in a thread; `out["error"]` keeps what ended it early (a cut connection)."""
    out: dict = {"started": threading.Event()}

    def run() -> None:
        try:
            target(url, out)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _grpc_text(results: list) -> str:
    assert all(error is None for _, error in results), results
    return "".join(
        r.as_numpy("text_output").reshape(-1)[0].decode()
        for r, _ in results
        if r.as_numpy("text_output") is not None
    )


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("drain-logs")


@pytest.fixture(scope="module")
def long_llava_dir(tmp_path_factory) -> str:
    """The tiny LLaVA with room for long answers."""
    out = tmp_path_factory.mktemp("long_llava")
    return str(make_checkpoint("llava", out, preset="tiny", max_position=2048))


def test_sigterm_drains_the_streams_in_flight_then_exits_0(long_llava_dir, log_dir):
    with start_server(long_llava_dir, log_dir, "--served-model-name", "tiny_llava") as handle:
        url = handle.http_url
        want = httpx.post(
            f"{url}/v2/models/tensorrt_llm_bls/generate",
            json={**BODY, "exclude_input_in_output": True},
            timeout=120,
        ).json()["text_output"]
        streams = [
            _start(_triton_stream, url),
            _start(_openai_stream, url),
            _start(_grpc_stream, handle.grpc_url),
        ]
        for _, out in streams:
            assert out["started"].wait(60)
        os.killpg(handle.proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        assert handle.proc.poll() is None  # still serving the streams
        assert httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 503
        assert httpx.get(f"{url}/v2/health/live", timeout=5).status_code == 200
        new = httpx.post(f"{url}/v2/models/ensemble/generate", json=BODY, timeout=30)
        assert new.status_code == 503 and "shutting down" in new.json()["error"]
        openai_new = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny_llava", "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )
        assert openai_new.status_code == 503
        assert openai_new.json()["error"]["code"] == "server_shutting_down"
        grpc_client = grpcclient.InferenceServerClient(handle.grpc_url)
        assert not grpc_client.is_server_ready() and grpc_client.is_server_live()
        with pytest.raises(InferenceServerException, match="shutting down") as refused:
            grpc_client.infer("ensemble", _grpc_inputs())
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
        for thread, out in streams:
            thread.join(120)
            assert "error" not in out
        (_, triton), (_, openai), (_, grpc) = streams
        assert triton["status"] == 200 and all("error" not in e for e in triton["events"])
        assert "".join(e["text_output"] for e in triton["events"]) == want
        assert openai["status"] == 200 and openai["data"][-1] == "[DONE]"
        usage = json.loads(openai["data"][-2])["usage"]
        assert usage["completion_tokens"] == TOKENS
        assert _grpc_text(grpc["results"]) == want
        assert handle.proc.wait(60) == 0
        assert "draining" in handle.log()


def test_the_exit_timeout_cuts_what_is_left_and_a_second_signal_stops_at_once(
    long_llava_dir, log_dir
):
    with start_server(long_llava_dir, log_dir, "--exit-timeout-secs", "0.5") as handle:
        thread, out = _start(_triton_stream, handle.http_url)
        assert out["started"].wait(60)
        os.killpg(handle.proc.pid, signal.SIGTERM)
        assert handle.proc.wait(30) == 0
        thread.join(30)
        assert "exit timeout: 1 requests still in flight are cut" in handle.log()
    with start_server(long_llava_dir, log_dir) as handle:
        thread, out = _start(_triton_stream, handle.http_url)
        assert out["started"].wait(60)
        os.killpg(handle.proc.pid, signal.SIGTERM)
        time.sleep(0.2)
        t0 = time.monotonic()
        os.killpg(handle.proc.pid, signal.SIGTERM)
        handle.proc.wait(30)
        assert time.monotonic() - t0 < 10 and "second signal" in handle.log()
        thread.join(30)
        assert isinstance(out.get("error"), httpx.HTTPError)  # cut, not finished
