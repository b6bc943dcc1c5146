"""`mmserve serve --ray-address ... --ray-autoscaling-config JSON` on a real two-node Ray cluster on loopback
(tests/server/ray_cluster.py): Ray Serve's own autoscaler, fed the queue depth, grows the engine deployment from one
replica to two under a sustained burst of long generate requests, the new replica serves (its own counters rise in
`/metrics/replicas`), every request succeeds, and once the burst ends it shrinks back to one replica."""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve", reason="replicas on Ray Serve need pip install mmserve[ray]")

from tests.server.ray_cluster import (  # noqa: E402
    REPLICA,
    local_ray_cluster,
    replica_values,
    serve_on_cluster,
)

# target 1 request in flight per replica: a burst of 8 asks for 8, capped at 2 (one per one-CPU node); quick
# metrics and no upscale delay so the test does not wait on Ray's defaults (30 s up, 600 s down)
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 0,
    "downscale_delay_s": 2,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 1,
}
TOKENS = "mmserve_generation_tokens_total"
CONCURRENCY = 8
OUTPUT_TOKENS = 300  # the tiny LLaVA's 512 positions hold the prompt and these


@pytest.fixture(scope="module")
def autoscaled_server(tiny_llava_dir):
    with local_ray_cluster() as (address, temp):
        config = json.dumps(AUTOSCALING)
        with serve_on_cluster(
            tiny_llava_dir, address, temp, "--ray-autoscaling-config", config
        ) as handle:
            yield handle


def _wait_for(what: str, check, timeout: float, log) -> object:
    """Poll `check()` once a second until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(1)
    raise AssertionError(f"{what} within {timeout:.0f} s:\n{log()[-4000:]}")


class Burst:
    """`CONCURRENCY` clients, each sending long Triton generate requests back to back (distinct prompts, so the
    affinity router spreads them by load) until stopped; every response's status, text and replica is kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.numbers = itertools.count()
        self.lock = threading.Lock()
        self.failures: list[str] = []
        self.served: dict[str, int] = {}
        self.pool = ThreadPoolExecutor(CONCURRENCY)
        self.clients = [self.pool.submit(self._client) for _ in range(CONCURRENCY)]

    def _client(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                n = next(self.numbers)
                body = {
                    "text_input": f"USER: request {n}, tell me a long story ASSISTANT:",
                    "max_tokens": OUTPUT_TOKENS,
                    "min_tokens": OUTPUT_TOKENS,
                }
                r = client.post(f"{self.url}/v2/models/ensemble/generate", json=body)
                with self.lock:
                    if r.status_code != 200 or not r.json().get("text_output"):
                        self.failures.append(f"{r.status_code}: {r.text[:300]}")
                    else:
                        replica = r.headers[REPLICA]
                        self.served[replica] = self.served.get(replica, 0) + 1

    def finish(self) -> None:
        self.stop.set()
        for client in self.clients:
            client.result()  # an exception in a client (a dropped connection) fails the test here
        self.pool.shutdown()


@pytest.mark.slow
def test_replicas_follow_the_queue_depth(autoscaled_server):
    url, log = autoscaled_server.http_url, autoscaled_server.log
    # serve returned once Ray Serve had min_replicas running: one replica, nothing asking for more
    start = _wait_for("a replica listed", lambda: replica_values(url, TOKENS), 60, log)
    assert len(start) == 1, start
    (first,) = start

    burst = Burst(url)
    try:

        def second_replica_served() -> dict[str, float] | None:
            values = replica_values(url, TOKENS)
            new = [r for r in values if r != first]
            return values if len(values) == 2 and values[new[0]] > 0 else None

        # the new replica loads its engine on a busy two-core machine before it serves
        scaled = _wait_for("a second replica serving", second_replica_served, 300, log)
    finally:
        burst.finish()
    (second,) = set(scaled) - {first}
    assert not burst.failures, burst.failures
    assert burst.served.get(first, 0) > 0 and burst.served.get(second, 0) > 0, burst.served
    after = replica_values(url, TOKENS)
    assert after[second] >= OUTPUT_TOKENS, after  # at least one whole request of its own

    # no requests in flight: down to min_replicas after downscale_delay_s (and the replica's graceful stop)
    def one_replica() -> dict[str, float] | None:
        values = replica_values(url, TOKENS)
        return values if len(values) == 1 else None

    (remaining,) = _wait_for("back to one replica", one_replica, 180, log)
    assert remaining in (first, second)
    r = httpx.post(
        f"{url}/v2/models/ensemble/generate",
        json={"text_input": "USER: after the burst ASSISTANT:", "max_tokens": 8},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers[REPLICA] == remaining, (r.status_code, r.text)
