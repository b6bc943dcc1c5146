"""X-Request-Id on a real server: a client's id comes back in the response header and names the engine requests of
its HTTP request (OpenAI `n`: `<id>`, `<id>-1`, ...), a missing or unusable one is replaced by a fresh id, and a
refused request's reason is logged with its id; the startup line gives the KV cache in tokens and the concurrency it
allows."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server.conftest import start_server

CHAT = "/v1/chat/completions"


def _chat(server, headers: dict, **kw) -> httpx.Response:
    body = {"model": "ensemble", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return httpx.post(f"{server.http_url}{CHAT}", json={**body, **kw}, headers=headers, timeout=60)


def test_a_clients_request_id_comes_back_and_a_bad_one_is_replaced(server):
    r = _chat(server, {"X-Request-Id": "client-abc-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-abc-1"
    fresh = _chat(server, {})
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["x-request-id"])
    bad = _chat(server, {"X-Request-Id": "x" * 200})
    assert bad.headers["x-request-id"] != "x" * 200
    ready = httpx.get(f"{server.http_url}/v2/health/ready", headers={"X-Request-Id": "probe"})
    assert ready.headers["x-request-id"] == "probe"


@pytest.fixture(scope="module")
def info_server(tiny_llava_dir, tmp_path_factory):
    """A server logging at info (the operator's default; the shared test server logs warnings only)."""
    with start_server(tiny_llava_dir, tmp_path_factory.mktemp("ids"), "--log-level", "info") as s:
        yield s


def test_a_refusal_is_logged_with_its_reason_and_id(info_server):
    server = info_server
    r = _chat(server, {"X-Request-Id": "refused-42"}, max_tokens=-3)
    assert r.status_code == 400 and r.headers["x-request-id"] == "refused-42"
    triton = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate",
        json={"text_input": "Hi"},  # max_tokens missing
        headers={"X-Request-Id": "refused-43"},
        timeout=60,
    )
    assert triton.status_code == 400
    log = server.log()
    assert re.search(r"400 .*max_tokens.*\(request refused-42\)", log), log[-2000:]
    assert re.search(r"400 .*max_tokens.*\(request refused-43\)", log), log[-2000:]
    startup = re.search(
        r"KV cache (\d+) tokens .*: ([\d.]+) requests of the full (\d+) tokens", log
    )
    assert startup and float(startup[2]) == round(int(startup[1]) / int(startup[3]), 1)
