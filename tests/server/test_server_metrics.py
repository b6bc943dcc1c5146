"""/metrics of a real server: request counters, latency histograms, token counters, engine gauges; and the
server under disconnects and a concurrent mix of OpenAI and Triton requests."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from mmserve.testing import image_to_data_uri, make_test_image

CHAT = "/v1/chat/completions"


def scrape(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels but model_name): value} of the server's /metrics; every mmserve_* sample names
    the served model (`model_name`: the checkpoint directory's name here), so replicas aggregate by model."""
    resp = httpx.get(f"{server.http_url}/metrics", timeout=30)
    assert resp.status_code == 200
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = dict(s.labels)
            if s.name.startswith("mmserve_") and not s.name.startswith("mmserve_engine_step"):
                assert labels.pop("model_name") == Path(server.model_dir).name, s
            if s.name != "mmserve_lora_requests_info":
                out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(server, content, max_tokens: int = 8, system: str | None = None, **kw) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body = {
        "model": "ensemble",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }
    return httpx.post(f"{server.http_url}{CHAT}", json=body, timeout=60)


def image_content(seed: int, text: str = "Describe the picture.") -> list[dict]:
    return [
        {"type": "image_url", "image_url": {"url": image_to_data_uri(make_test_image(seed))}},
        {"type": "text", "text": text},
    ]


def test_request_counters_by_endpoint_and_status(server):
    before = scrape(server)
    assert chat(server, "Hi").status_code == 200
    assert (
        httpx.post(
            f"{server.http_url}{CHAT}",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            timeout=30,
        ).status_code
        == 404
    )
    after = scrape(server)
    for status in ("200", "404"):
        key = dict(endpoint=CHAT, status=status)
        assert (
            value(after, "mmserve_requests_total", **key)
            == value(before, "mmserve_requests_total", **key) + 1
        )


def test_latency_histograms_and_token_counters_follow_a_request(server):
    before = scrape(server)
    resp = chat(server, image_content(31), max_tokens=8, ignore_eos=True)
    usage = resp.json()["usage"]
    after = scrape(server)
    for hist in (
        "mmserve_time_to_first_token_seconds",
        "mmserve_inter_token_latency_seconds",
        "mmserve_e2e_request_latency_seconds",
    ):
        assert value(after, hist + "_count") == value(before, hist + "_count") + 1, hist
        assert value(after, hist + "_sum") > value(before, hist + "_sum"), hist
    assert (
        value(after, "mmserve_prompt_tokens_total") - value(before, "mmserve_prompt_tokens_total")
        == usage["prompt_tokens"]
    )
    assert (
        value(after, "mmserve_generation_tokens_total")
        - value(before, "mmserve_generation_tokens_total")
        == usage["completion_tokens"]
        == 8
    )


def test_engine_step_counters_by_kind_follow_a_request(server):
    kinds = ("decode", "prefill", "mixed")
    before = scrape(server)
    resp = chat(server, image_content(37), max_tokens=8, ignore_eos=True)
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    after = scrape(server)

    def grown(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # the prompt (less any cached blocks) and 7 decode inputs; the 8th token is sampled, never fed back
    tokens = sum(grown("mmserve_engine_step_tokens_total", kind=k) for k in kinds)
    assert 7 < tokens <= prompt_tokens + 7
    assert grown("mmserve_engine_steps_total", kind="decode") >= 6
    assert grown("mmserve_engine_step_seconds_total", kind="decode", part="host") > 0
    assert all(
        grown("mmserve_engine_step_seconds_total", kind=k, part=p) >= 0
        for k in kinds
        for p in ("host", "device_wait")
    )


def test_engine_gauges_are_exported_and_idle_after_requests(server):
    metrics = scrape(server)
    for gauge in (
        "mmserve_num_requests_running",
        "mmserve_num_requests_waiting",
        "mmserve_kv_cache_usage_ratio",
        "mmserve_prefix_cache_hit_rate",
        "mmserve_encoder_cache_hit_rate",
    ):
        assert (gauge, ()) in metrics, gauge
    assert (
        value(metrics, "mmserve_num_requests_running")
        == value(metrics, "mmserve_num_requests_waiting")
        == 0
    )
    assert value(metrics, "mmserve_kv_cache_usage_ratio") == 0


def test_same_image_and_prompt_twice_hits_the_prefix_cache(server):
    before = value(scrape(server), "mmserve_prompt_end_cache_hits")
    first = chat(server, image_content(32)).json()
    second = chat(server, image_content(32)).json()
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    metrics = scrape(server)
    assert value(metrics, "mmserve_prefix_cache_hit_rate") > 0
    # an exact repeat: its first token came from the first request's kept final hidden state
    assert value(metrics, "mmserve_prompt_end_cache_hits") == before + 1


def test_cache_queries_hits_and_preemptions_are_counters(server):
    """Counters sum over replicas (ratio gauges cannot): prefix-cache tokens queried and hit, encoder-cache pictures
    queried and hit, preemptions; and the LoRA info gauge the Gateway API Inference Extension reads."""
    before = scrape(server)
    assert chat(server, image_content(35), system="One.").status_code == 200
    assert (
        chat(server, image_content(35), system="One.").status_code == 200
    )  # the same prompt: a prefix hit
    assert (
        chat(server, image_content(35), system="Two, longer.").status_code == 200
    )  # encoder-cache hit
    after = scrape(server)
    grew = lambda name: value(after, name) - value(before, name)  # noqa: E731
    assert (
        grew("mmserve_prefix_cache_queried_tokens_total")
        >= grew("mmserve_prefix_cache_hit_tokens_total")
        > 0
    )
    assert (
        grew("mmserve_encoder_cache_queries_total") >= 2
        and grew("mmserve_encoder_cache_hits_total") >= 1
    )
    assert ("mmserve_preemptions_total", ()) in after
    text = httpx.get(f"{server.http_url}/metrics", timeout=30).text
    (info,) = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "mmserve_lora_requests_info"
    ]
    assert info.labels["running_lora_adapters"] == info.labels["waiting_lora_adapters"] == ""
    assert int(info.labels["max_lora"]) >= 1 and info.value > 1.7e9  # the scrape time


def test_same_image_after_a_different_prefix_hits_the_encoder_cache(server):
    # a different system prompt changes the first KV block, so the image must be encoded again: from the cache
    assert chat(server, image_content(33), system="You are terse.").status_code == 200
    assert chat(server, image_content(33), system="You are verbose and kind.").status_code == 200
    assert value(scrape(server), "mmserve_encoder_cache_hit_rate") > 0


def test_disconnect_mid_stream_frees_the_kv_cache(server):
    body = {
        "model": "ensemble",
        "messages": [{"role": "user", "content": image_content(34)}],
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.http_url}{CHAT}", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 2:
                break
    deadline = time.monotonic() + 5
    while True:
        metrics = scrape(server)
        if (
            value(metrics, "mmserve_kv_cache_usage_ratio") == 0
            and value(metrics, "mmserve_num_requests_running") == 0
        ):
            break
        assert time.monotonic() < deadline, "KV blocks still held 5 s after the client disconnected"
        time.sleep(0.1)
    assert chat(server, "Still there?").status_code == 200


def test_32_concurrent_openai_and_triton_requests_all_succeed(server):
    uri = image_to_data_uri(make_test_image(35))

    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, str]:
        kind = ("chat", "generate", "completions")[i % 3]
        if kind == "chat":
            resp = await client.post(
                CHAT,
                json={
                    "model": "ensemble",
                    "max_tokens": 6,
                    "messages": [{"role": "user", "content": image_content(35, f"Question {i}?")}],
                },
            )
            text = (
                resp.json()["choices"][0]["message"]["content"]
                if resp.status_code == 200
                else resp.text
            )
        elif kind == "generate":
            resp = await client.post(
                "/v2/models/ensemble/generate",
                json={"text_input": f"Question {i}?", "image_url_input": uri, "max_tokens": 6},
            )
            text = resp.json()["text_output"] if resp.status_code == 200 else resp.text
        else:
            resp = await client.post(
                "/v1/completions",
                json={"model": "ensemble", "prompt": f"Story {i}:", "max_tokens": 6},
            )
            text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
        assert resp.status_code == 200, (kind, text)
        return kind, text

    async def burst() -> list[tuple[str, str]]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(
            base_url=server.http_url, timeout=120, limits=limits
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    before = scrape(server)
    results = asyncio.run(burst())
    after = scrape(server)
    assert len(results) == 32 and all(isinstance(text, str) for _, text in results)
    for endpoint, count in (
        (CHAT, 11),
        ("/v2/models/{model}/generate", 11),
        ("/v1/completions", 10),
    ):
        key = dict(endpoint=endpoint, status="200")
        assert (
            value(after, "mmserve_requests_total", **key)
            - value(before, "mmserve_requests_total", **key)
            == count
        ), endpoint
