"""`mmserve serve --data-parallel-size 2 --ray-address ...` on a real two-node Ray cluster on loopback (a head and a
worker started with `ray start`, one CPU each, so Ray puts one engine replica on each node): requests through Ray's
HTTP proxy succeed with the real httpx / tritonclient / openai clients, both replicas serve, the same picture keeps
to one replica whose prefix-cache hits rise while the other's do not, and a killed replica's stream ends with an
error while Ray starts a replacement."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="replicas on Ray Serve need pip install mmserve[ray]")

from mmserve.testing.images import image_to_data_uri  # noqa: E402
from tests.server.ray_cluster import (  # noqa: E402
    PID,
    REPLICA,
    local_ray_cluster,
    replica_values,
    serve_on_cluster,
)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tiny_llava_dir):
    address, temp = ray_cluster
    with serve_on_cluster(tiny_llava_dir, address, temp, "--data-parallel-size", "2") as handle:
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
    return replica_values(url, "mmserve_prefix_cache_hit_tokens_total")


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
