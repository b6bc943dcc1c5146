"""`mmserve serve --data-parallel-size 2 --ray-address ...` on a real two-node Ray cluster on loopback (a head and a
worker started with `ray start`, one CPU each, so Ray puts one engine replica on each node): requests through Ray's
HTTP proxy succeed with the real httpx / tritonclient / openai clients, both replicas serve, the same picture keeps
to one replica whose prefix-cache hits rise while the other's do not, and a killed replica's stream ends with an
error while Ray starts a replacement."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server.conftest import free_port, start_server

pytest.importorskip("ray.serve", reason="replicas on Ray Serve need pip install mmserve[ray]")

from mmserve.testing.images import image_to_data_uri  # noqa: E402

RAY = str(Path(sys.executable).with_name("ray"))
REPLICA = "x-mmserve-replica"
PID = "x-mmserve-replica-pid"
HIT = re.compile(r'^mmserve_prefix_cache_hit_tokens_total\{.*replica="([^"]+)".*\} (\S+)$', re.M)


def _ray_node(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    """`ray start --block ...` in its own session: killing the group ends the node and its workers."""
    with open(log, "w") as out:
        return subprocess.Popen(
            [RAY, "start", "--block", "--num-cpus", "1", "--disable-usage-stats", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # workers the node left behind
        os.killpg(proc.pid, signal.SIGKILL)


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited {proc.returncode}:\n{log.read_text()}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"Ray's head did not listen on {port}:\n{log.read_text()}")


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a worker node on 127.0.0.1 with a private temp dir (short: Ray's socket paths must fit)."""
    temp = Path(tempfile.mkdtemp(prefix="mmray", dir="/tmp"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    port = free_port()
    nodes = []
    try:
        common = ("--node-ip-address", "127.0.0.1")
        head = [
            "--head",
            "--port",
            str(port),
            "--include-dashboard=false",
            "--temp-dir",
            str(temp),
            "--ray-client-server-port",
            str(free_port()),
        ]
        nodes.append(_ray_node(*common, *head, env=env, log=temp / "head.log"))
        _wait_port(port, nodes[0], temp / "head.log")
        worker = ["--address", f"127.0.0.1:{port}"]
        agent = ("--dashboard-agent-listen-port", str(free_port()))
        nodes.append(_ray_node(*common, *worker, *agent, env=env, log=temp / "worker.log"))
        yield f"127.0.0.1:{port}", temp
    finally:
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tiny_llava_dir):
    address, temp = ray_cluster
    with (
        start_server(
            tiny_llava_dir,
            temp,
            "--data-parallel-size",
            "2",
            "--ray-address",
            address,
            "--grpc-port",
            "-1",
            "--num-kv-blocks",  # two engines on a small shared machine: CPU's default fills a share of RAM
            "512",
            "--log-level",
            "info",
            timeout=300,
        ) as handle
    ):
        # Ray's proxy answers once one replica is up; `serve` logs this when the application has both
        deadline = time.monotonic() + 300
        while "engine replica(s) behind" not in handle.log():
            assert time.monotonic() < deadline and handle.proc.poll() is None, handle.log()
            time.sleep(0.5)
        yield handle


@pytest.fixture
def tiny_image():
    from PIL import Image

    return Image.fromarray(np.random.RandomState(0).randint(0, 255, (32, 32, 3), dtype=np.uint8))


def _generate(url: str, text: str, image: str | None = None, max_tokens: int = 8) -> httpx.Response:
    body = {"text_input": text, "max_tokens": max_tokens}
    if image is not None:
        body["image_url_input"] = image
    return httpx.post(f"{url}/v2/models/ensemble/generate", json=body, timeout=120)


def _hits(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics/replicas", timeout=30).text
    return {replica: float(value) for replica, value in HIT.findall(text)}


def test_requests_succeed_and_both_replicas_serve(ray_server):
    import openai
    import tritonclient.http as triton_http

    url = ray_server.http_url
    texts = [f"USER: question number {i} about nothing in particular ASSISTANT:" for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda t: _generate(url, t), texts))
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses]
    assert all(r.json()["text_output"] for r in responses)
    replicas = {r.headers[REPLICA] for r in responses}
    assert len(replicas) == 2, replicas
    assert len({r.headers[PID] for r in responses}) == 2

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hello there", max_tokens=4)
    assert out.choices[0].text is not None and out.usage.completion_tokens >= 1

    triton = triton_http.InferenceServerClient(url.removeprefix("http://"))
    assert triton.is_server_ready()
    text = triton_http.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"USER: hi ASSISTANT:"]], dtype=object))
    tokens = triton_http.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    result = triton.infer("ensemble", [text, tokens])
    assert result.as_numpy("text_output").size == 1

    summed = httpx.get(f"{url}/metrics", timeout=30).text
    total = re.search(r"^mmserve_generation_tokens_total\{[^}]*\} (\S+)$", summed, re.M)
    per_replica = httpx.get(f"{url}/metrics/replicas", timeout=30).text
    parts = re.findall(r"^mmserve_generation_tokens_total\{[^}]*\} (\S+)$", per_replica, re.M)
    assert total is not None and len(parts) == 2
    assert (
        float(total.group(1)) == pytest.approx(sum(map(float, parts))) and float(total.group(1)) > 0
    )


def test_same_picture_keeps_to_one_replica(ray_server, tiny_image):
    url = ray_server.http_url
    before = _hits(url)
    assert len(before) == 2, before
    picture = image_to_data_uri(tiny_image)
    prompt = "USER: <image>\nWhat is in this picture? ASSISTANT:"
    responses = [_generate(url, prompt, picture) for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
    served = {r.headers[REPLICA] for r in responses}
    assert len(served) == 1, served
    (home,) = served
    after = _hits(url)
    other = next(r for r in before if r != home)
    assert after[home] > before[home], (before, after)
    assert after[other] == before[other], (before, after)


def test_killed_replica_is_replaced_and_its_stream_ends_with_an_error(ray_server, tiny_image):
    url = ray_server.http_url
    picture = image_to_data_uri(tiny_image.rotate(90))
    prompt = "USER: <image>\nTell me a very long story. ASSISTANT:"
    first = _generate(url, prompt, picture, max_tokens=1)
    victim, pid = first.headers[REPLICA], int(first.headers[PID])
    body = {"text_input": prompt, "image_url_input": picture, "stream": True}
    body |= {"max_tokens": 100_000, "min_tokens": 100_000}  # to the model's length: ~0.3 s here
    started = time.monotonic()
    events = []
    with httpx.stream(
        "POST", f"{url}/v2/models/ensemble/generate_stream", json=body, timeout=60
    ) as stream:
        assert stream.status_code == 200 and stream.headers[REPLICA] == victim
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - started < 60
    assert "error" in events[-1] and "replica" in events[-1]["error"], events[-1]
    assert "error" not in events[0] and len(events) < 100

    deadline = time.monotonic() + 180  # Ray notices the death, starts a replica, the engine loads
    replicas: set[str] = set()
    while time.monotonic() < deadline:
        replicas = set(
            _hits(url)
        )  # every live replica answers the broadcast behind /metrics/replicas
        if len(replicas) == 2 and victim not in replicas:
            break
        time.sleep(1)
    assert len(replicas) == 2 and victim not in replicas, (victim, replicas)
    assert _generate(url, "USER: after the kill ASSISTANT:").status_code == 200
