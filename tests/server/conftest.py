"""A real `mmserve serve` subprocess on 127.0.0.1 with free ports, an in-process server with slow engine steps
(to watch what a request leaves running), and a local HTTP server for media URLs."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from mmserve.engine.engine import Engine
    from mmserve.entrypoints.state import ServerState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    model_dir: str
    log_path: Path
    scheme: str = "http"

    @property
    def http_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def start_server(
    model_dir: str, log_dir: Path, *extra: str, timeout: float = 120.0, https_ca: str | None = None
):
    """Start `mmserve serve` and wait for /v2/health/ready (over HTTPS trusting `https_ca` when given); always
    terminate it."""
    http_port, grpc_port = free_port(), free_port()
    log_path = log_dir / f"server-{http_port}.log"
    cmd = [
        sys.executable,
        "-m",
        "mmserve.entrypoints.cli",
        "serve",
        model_dir,
        "--host",
        "127.0.0.1",
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--device",
        "cpu",
        "--allow-private-media-urls",
        "--log-level",
        "warning",
        *extra,
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    handle = ServerHandle(
        proc, http_port, grpc_port, model_dir, log_path, "https" if https_ca else "http"
    )
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.log()}")
            try:
                if (
                    httpx.get(
                        f"{handle.http_url}/v2/health/ready",
                        timeout=1,
                        verify=ssl.create_default_context(cafile=https_ca) if https_ca else True,
                    ).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"server not ready after {timeout}s:\n{handle.log()}")
            time.sleep(0.2)
        yield handle
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="session")
def server(tiny_llava_dir, tmp_path_factory):
    """One shared server for the session (default settings, private media URLs allowed)."""
    with start_server(tiny_llava_dir, tmp_path_factory.mktemp("server-logs")) as handle:
        yield handle


class _MediaHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def media_server(tmp_path_factory):
    """Serves files from a temp dir on 127.0.0.1; yields (base_url, directory)."""
    root = tmp_path_factory.mktemp("media")
    handler = lambda *a, **kw: _MediaHandler(*a, directory=str(root), **kw)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    finally:
        httpd.shutdown()


def ensemble_texts(server: ServerHandle, texts: list[str], max_tokens: int = 10) -> list[str]:
    """text_output of one batched greedy `/v2/models/ensemble/generate` request over `texts`."""
    r = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate",
        json={
            "text_input": texts,
            "max_tokens": [max_tokens] * len(texts),
            "temperature": [0] * len(texts),
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


@dataclass
class InProcessServer:
    url: str
    engine: Engine  # the engine itself: has_unfinished(), kv.usage
    state: ServerState  # in_flight, config
    grpc_url: str | None = None


@contextlib.contextmanager
def in_process_server(model_dir: str, step_delay_s: float = 0.0, grpc: bool = False):
    """mmserve's HTTP (and with `grpc`, gRPC) server in this process, on one event loop in a thread as `mmserve
    serve` runs them, so a test can see the engine and patch the code the servers run. With step_delay_s each engine
    step takes at least that long, so a long request runs for seconds and a test can see what is still running
    (engine, KV blocks, in-flight count) after the client left."""
    import uvicorn

    from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.engine import Engine
    from mmserve.entrypoints.http_server import build_app
    from mmserve.entrypoints.server_config import ServerConfig
    from mmserve.entrypoints.state import ServerState
    from mmserve.entrypoints.triton.grpc_server import start_grpc_server
    from mmserve.multimodal.media_limits import MediaConfig

    media = MediaConfig()
    engine = Engine(
        EngineConfig(ModelConfig(model_dir, device="cpu"), CacheConfig(), SchedulerConfig()), media
    )
    if step_delay_s:
        step = engine.step

        def slow_step():
            time.sleep(step_delay_s)
            return step()

        engine.step = slow_step
    port, grpc_port = free_port(), free_port() if grpc else -1
    state = ServerState(
        AsyncEngine(engine),
        ServerConfig(http_port=port, grpc_port=grpc_port),
        media,
        model_dir,
        engine.hf_config.model_type,
    )
    server = uvicorn.Server(
        uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning")
    )

    async def serve() -> None:
        grpc_server = None
        if grpc:
            grpc_server, _ = await start_grpc_server(state, "127.0.0.1", grpc_port)
        try:
            await server.serve()
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace=1)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield InProcessServer(
            f"http://127.0.0.1:{port}", engine, state, f"127.0.0.1:{grpc_port}" if grpc else None
        )
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        state.engine.shutdown()


def slow_server(model_dir: str, step_delay_s: float = 0.02):
    """An in-process HTTP server whose engine steps take >= step_delay_s (in_process_server)."""
    return in_process_server(model_dir, step_delay_s)


def serve_with(model_dir: str, *flags: str) -> subprocess.CompletedProcess:
    """`mmserve serve model_dir --device cpu *flags` run to its end (for flags that must stop it at startup)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mmserve.entrypoints.cli",
            "serve",
            model_dir,
            "--device",
            "cpu",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
