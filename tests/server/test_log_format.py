"""--log-format json and --log-requests on a real server: every line the server logs (ours, uvicorn's access
lines, the stats and request lines) is one JSON object; a finished request's line carries its id, token counts,
TTFT, e2e and finish reason."""

from __future__ import annotations

import json

import httpx

from mmserve.testing import image_to_data_uri, make_test_image
from tests.server.conftest import start_server


def test_json_lines_and_one_line_per_finished_request(tiny_llava_dir, tmp_path):
    with start_server(
        tiny_llava_dir, tmp_path, "--log-level", "info", "--log-format", "json", "--log-requests"
    ) as server:
        body = {
            "text_input": "What is this?",
            "max_tokens": 3,
            "image_url_input": image_to_data_uri(make_test_image(7)),
        }
        r = httpx.post(
            f"{server.http_url}/v2/models/ensemble/generate",
            json=body,
            headers={"X-Request-Id": "logged-1"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        bad = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json={"text_input": "x"})
        assert bad.status_code == 400
        lines = [ln for ln in server.log().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line parses
    assert {"time", "level", "logger", "message"} <= set(records[0])
    (done,) = [r for r in records if r.get("request_id") == "logged-1"]
    assert done["logger"] == "mmserve.requests" and done["finish_reason"] == "length"
    assert done["output_tokens"] == 3 and done["image_tokens"] == 9
    assert done["prompt_tokens"] > done["image_tokens"] and 0 < done["ttft_s"] <= done["e2e_s"]
    assert any(r["logger"].startswith("uvicorn") for r in records)  # the HTTP server's lines too
    assert any(r["message"].startswith("400 ") for r in records)


def test_tensor_parallel_workers_log_in_the_servers_format(tiny_llava_dir, tmp_path):
    """The spawned rank's lines are JSON too, saying which rank wrote them."""
    with start_server(
        tiny_llava_dir,
        tmp_path,
        "--log-level",
        "info",
        "--log-format",
        "json",
        "--tensor-parallel-size",
        "2",
    ) as server:
        r = httpx.post(
            f"{server.http_url}/v2/models/ensemble/generate",
            json={"text_input": "hi", "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        lines = [ln for ln in server.log().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line parses, the worker's included
    worker = [r for r in records if r.get("origin") == "tp1 node0"]
    assert any("joined the tensor-parallel group" in r["message"] for r in worker)
