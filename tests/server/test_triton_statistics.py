"""Triton's statistics extension on a real server: HTTP `/v2/models[/<model>]/stats` and gRPC `ModelStatistics`
(what perf_analyzer reads) count each model's successes, failures and batch items, and time the phases of its
requests; both protocols give the same numbers; a stream the client drops counts as a fail."""

from __future__ import annotations

import time

import httpx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

GENERATE = {"text_input": "USER:\nhello ASSISTANT:", "max_tokens": 4}


def _stats(server, model: str = "ensemble") -> dict:
    doc = httpx.get(f"{server.http_url}/v2/models/{model}/stats").json()
    [entry] = doc["model_stats"]
    assert entry["name"] == model and entry["version"] == "1"
    return entry


def _counts(entry: dict) -> dict:
    return {p: d["count"] for p, d in entry["inference_stats"].items()} | {
        "inference_count": entry["inference_count"],
        "execution_count": entry["execution_count"],
    }


def test_requests_are_counted_and_timed_per_model(server):
    url, t0_ms = server.http_url, int(time.time() * 1000)
    before, bls_before = _stats(server), _stats(server, "tensorrt_llm_bls")
    for _ in range(2):
        assert httpx.post(f"{url}/v2/models/ensemble/generate", json=GENERATE).status_code == 200
    assert (
        httpx.post(
            f"{url}/v2/models/ensemble/generate_stream", json=GENERATE | {"stream": True}
        ).status_code
        == 200
    )
    too_long = httpx.post(
        f"{url}/v2/models/ensemble/generate", json=GENERATE | {"text_input": "word " * 20000}
    )
    assert too_long.status_code == 400  # accepted inputs, refused by the engine: a fail
    after = _stats(server)
    delta = {k: v - _counts(before)[k] for k, v in _counts(after).items()}
    assert delta == {
        "success": 3,
        "fail": 1,
        "queue": 3,
        "compute_input": 3,
        "compute_infer": 3,
        "compute_output": 3,
        "cache_hit": 0,
        "cache_miss": 0,
        "inference_count": 4,
        "execution_count": 4,
    }
    ns = {
        p: after["inference_stats"][p]["ns"] - before["inference_stats"][p]["ns"]
        for p in after["inference_stats"]
    }
    assert ns["compute_infer"] > 0 and ns["success"] >= ns["compute_infer"] + ns["queue"]
    assert after["last_inference"] >= t0_ms
    assert _counts(_stats(server, "tensorrt_llm_bls")) == _counts(bls_before)  # per model name


def test_every_model_listed_and_unknown_models_refused(server):
    doc = httpx.get(f"{server.http_url}/v2/models/stats").json()
    names = [m["name"] for m in doc["model_stats"]]
    assert names[:3] == ["ensemble", "tensorrt_llm_bls", "tensorrt_llm"] and len(names) >= 4
    assert httpx.get(f"{server.http_url}/v2/models/nope/stats").status_code == 404
    assert httpx.get(f"{server.http_url}/v2/models/ensemble/versions/1/stats").status_code == 200
    assert "statistics" in httpx.get(f"{server.http_url}/v2").json()["extensions"]


def test_grpc_and_the_http_client_read_the_same_numbers(server):
    assert (
        httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=GENERATE).status_code
        == 200
    )
    http_entry = _stats(server)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        grpc_entry = client.get_inference_statistics("ensemble", as_json=True)["model_stats"][0]
        everything = client.get_inference_statistics(as_json=True)["model_stats"]
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.get_inference_statistics("nope")
    assert int(grpc_entry["inference_count"]) == http_entry["inference_count"] > 0
    assert (
        int(grpc_entry["inference_stats"]["success"]["count"])
        == http_entry["inference_stats"]["success"]["count"]
    )
    assert (
        int(grpc_entry["inference_stats"]["compute_infer"]["ns"])
        == http_entry["inference_stats"]["compute_infer"]["ns"]
    )
    assert {e["name"] for e in everything} >= {"ensemble", "tensorrt_llm_bls", "tensorrt_llm"}
    tc = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    assert (
        tc.get_inference_statistics("ensemble")["model_stats"][0]["inference_count"]
        == http_entry["inference_count"]
    )


def test_a_dropped_stream_counts_as_a_fail(server):
    before = _counts(_stats(server))
    with httpx.stream(
        "POST",
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        json=GENERATE | {"stream": True, "max_tokens": 200, "min_tokens": 200},
    ) as response:
        next(response.iter_lines())  # the first event, then the client goes away
    deadline = time.time() + 10
    while _counts(_stats(server))["fail"] == before["fail"] and time.time() < deadline:
        time.sleep(0.05)
    after = _counts(_stats(server))
    assert after["fail"] == before["fail"] + 1 and after["success"] == before["success"]


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of the /metrics sample `name` whose labels include `labels`."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_triton_and_tensorrt_llm_metric_families_on_metrics(server):
    """Dashboards and inference gateways set up for Triton + TensorRT-LLM read these names: the nv_inference_*
    counters agree with the statistics extension, the nv_trt_llm_* gauges with the engine (a request running)."""
    assert (
        httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=GENERATE).status_code
        == 200
    )
    entry, text = _stats(server), httpx.get(f"{server.http_url}/metrics").text
    assert (
        "nv_inference_request_success{" in text and "nv_inference_request_success_total" not in text
    )
    stats = entry["inference_stats"]
    assert (
        _metric(text, "nv_inference_request_success", model="ensemble", version="1")
        == stats["success"]["count"]
    )
    assert _metric(text, "nv_inference_count", model="ensemble") == entry["inference_count"]
    assert _metric(
        text, "nv_inference_compute_infer_duration_us", model="ensemble"
    ) == pytest.approx(stats["compute_infer"]["ns"] / 1000)
    blocks_total = _metric(text, "mmserve_kv_cache_blocks_total")
    assert (
        _metric(
            text,
            "nv_trt_llm_kv_cache_block_metrics",
            kv_cache_block_type="max",
            model="tensorrt_llm",
        )
        == blocks_total
        > 0
    )
    assert (
        _metric(text, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per") == 16
    )
    assert (
        _metric(text, "nv_trt_llm_request_metrics", request_type="max", model="tensorrt_llm") >= 1
    )
    with httpx.stream(
        "POST",
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        json=GENERATE | {"stream": True, "max_tokens": 300, "min_tokens": 300},
    ) as response:
        lines = (
            response.iter_lines()
        )  # (kept: a dropped iterator closes the stream and aborts the request)
        next(lines)  # running now
        busy = httpx.get(f"{server.http_url}/metrics").text
        for _ in lines:
            pass
    assert _metric(busy, "nv_trt_llm_request_metrics", request_type="scheduled") >= 1
    assert _metric(busy, "nv_trt_llm_request_metrics", request_type="active") >= 1
    used = _metric(busy, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")
    free = _metric(busy, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="free")
    assert used >= 1 and used + free == blocks_total
    assert (
        0 < _metric(busy, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction") <= 1
    )
