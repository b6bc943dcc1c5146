"""A real Ray cluster on loopback for the Ray Serve tests: a head and a worker node started with `ray start --block`
(one CPU each, so Ray puts one engine replica on each node), `mmserve serve ... --ray-address` on it, and readers of
the ingress's `/metrics/replicas` (every live replica's samples with a `replica` label)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.server.conftest import ServerHandle, free_port, start_server

RAY = str(Path(sys.executable).with_name("ray"))
REPLICA = "x-mmserve-replica"
PID = "x-mmserve-replica-pid"


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


@contextlib.contextmanager
def local_ray_cluster() -> Iterator[tuple[str, Path]]:
    """A head and a worker node on 127.0.0.1 with a private temp dir (short: Ray's socket paths must fit);
    yields (the head's HOST:PORT, the temp dir)."""
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


@contextlib.contextmanager
def serve_on_cluster(
    model_dir: str, address: str, log_dir: Path, *extra: str
) -> Iterator[ServerHandle]:
    """`mmserve serve MODEL --ray-address ADDRESS *extra` (HTTP only), yielded once `serve` logs that the
    application is up: Ray's proxy answers as soon as one replica is, `serve` once all of the first are."""
    with start_server(
        model_dir,
        log_dir,
        "--ray-address",
        address,
        "--grpc-port",
        "-1",
        "--num-kv-blocks",  # engines on a small shared machine: CPU's default fills a share of RAM
        "512",
        "--log-level",
        "info",
        *extra,
        timeout=300,
    ) as handle:
        deadline = time.monotonic() + 300
        while "engine replica(s) behind" not in handle.log():
            assert time.monotonic() < deadline and handle.proc.poll() is None, handle.log()
            time.sleep(0.5)
        yield handle


def replica_values(url: str, metric: str) -> dict[str, float]:
    """{replica id: `metric`'s value summed over its label sets} for every replica `/metrics/replicas` lists."""
    text = httpx.get(f"{url}/metrics/replicas", timeout=30).text
    pattern = re.compile(rf'^{re.escape(metric)}\{{.*replica="([^"]+)".*\}} (\S+)$', re.M)
    values: dict[str, float] = {}
    for replica, value in pattern.findall(text):
        values[replica] = values.get(replica, 0.0) + float(value)
    return values
