"""Start-up of `mmserve serve`: `serve org/name` serves a Hugging Face hub model ID from the hub cache (here a cache
written by the test, read with HF_HUB_OFFLINE=1: no network), under that ID; a model argument that names no servable
checkpoint stops `serve` with one line and status 2, and a taken port stops it, before any model loads."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_server

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tiny_llava_dir, tmp_path_factory) -> Path:
    """A hub cache holding acme/tiny-llava at `main` (the layout huggingface_hub writes)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny-llava"
    shutil.copytree(tiny_llava_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


def _serve(model: str, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", model, "--device", "cpu"]
    return subprocess.run(cmd + list(flags), capture_output=True, text=True, timeout=120, env=env)


def test_a_hub_model_id_is_served_from_the_cache_under_its_id(hub_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    with start_server("acme/tiny-llava", tmp_path) as handle:
        models = httpx.get(f"{handle.http_url}/v1/models", timeout=10).json()
        ids = [m["id"] for m in models["data"]]
        assert "acme/tiny-llava" in ids and COMMIT not in ids
        r = httpx.post(
            f"{handle.http_url}/v1/completions",
            json={"model": "acme/tiny-llava", "prompt": "hello", "max_tokens": 3},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _bad_dir(tmp_path: Path, config: dict | None) -> str:
    path = tmp_path / "ckpt"
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        (
            "hub-missing",
            r"model 'acme/missing': no such directory, and the hub model could not be fetched",
        ),
        ("no-dir", r"model '.*nowhere': no such directory \(and not a hub model ID"),
        ("no-config", r"has no config.json, so it is no checkpoint"),
        (
            "unsupported",
            r"architecture 'FooForCausalLM' is not supported; supported architectures: .*"
            r"LlavaForConditionalGeneration",
        ),
    ],
)
def test_a_model_that_is_no_servable_checkpoint_stops_serve_in_one_line(
    case, message, hub_cache, tmp_path
):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    model = {
        "hub-missing": lambda: "acme/missing",
        "no-dir": lambda: str(tmp_path / "nowhere"),
        "no-config": lambda: _bad_dir(tmp_path, None),
        "unsupported": lambda: _bad_dir(
            tmp_path, {"architectures": ["FooForCausalLM"], "model_type": "llama"}
        ),
    }[case]()
    run = _serve(model, env)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert re.search(message, lines[0]) and lines[0].startswith("mmserve serve: ")


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_taken_port_stops_serve_before_the_model_loads(flag, tiny_llava_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = "--grpc-port" if flag == "--http-port" else "--http-port"
        run = _serve(tiny_llava_dir, dict(os.environ), flag, str(port), other, "0")
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
    assert (
        f"mmserve serve: {flag} {port}: cannot listen on 127.0.0.1:{port} (Address already in use)"
        in (run.stderr)
    )


def test_an_autoscaling_config_alone_serves_on_ray_and_a_bad_one_stops_serve(tiny_llava_dir):
    """--ray-autoscaling-config without --ray-address is the Ray path (a local Ray), so its value is checked by Ray
    Serve's AutoscalingConfig before any Ray or model starts, not dropped."""
    pytest.importorskip("ray.serve")
    config = '{"min_replicas": 2, "max_replicas": 1}'
    run = _serve(tiny_llava_dir, dict(os.environ), "--ray-autoscaling-config", config)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "ray_autoscaling_config" in run.stderr, run.stderr
