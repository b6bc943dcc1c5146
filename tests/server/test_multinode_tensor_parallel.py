"""Multi-node tensor parallelism, with two "nodes" as two process trees on this machine (gloo over loopback): node 0
a real `mmserve serve --tensor-parallel-size 2 --nnodes 2 --node-rank 0`, node 1 a headless `mmserve serve ...
--node-rank 1` started first (it waits for node 0). Greedy tokens and log-probs, with and without a picture, are
one process's; the node layout also comes from the variables torchrun sets (by hand, and from torchrun itself);
node 0's shutdown ends node 1 with exit 0, a dead node 1 turns node 0 unavailable, a dead node 0 ends node 1 with
exit 1 and a log line. On two GPUs: two nodes of one GPU each over NCCL (`gpu`)."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import tritonclient.http as httpclient

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.images import image_to_data_uri
from tests.server.conftest import free_port, start_server
from tests.server.test_triton_tokens import http_infer, token_tensors

TP2 = ("--tensor-parallel-size", "2")
QUIET = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}  # two processes share the cores: no spinning
PROMPTS = [  # (text, picture seed or None)
    ("a cat on a mat", None),
    ("two dogs in the park", None),
    ("What is in the picture?", 3),
    ("Describe the colours.", 8),
]
N = 8


def serve_cmd(model_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", model_dir, *extra]


@contextlib.contextmanager
def worker_node(
    model_dir: str, log_path: Path, *extra: str, env: dict | None = None, device: str = "cpu"
):
    """A headless node (its own process tree) running `serve MODEL --device DEVICE *extra`; killed at the end if
    it is still running."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            serve_cmd(model_dir, "--device", device, *extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **QUIET, **(env or {})},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def nodes_flags(addr: str, node_rank: int) -> tuple[str, ...]:
    return (*TP2, "--nnodes", "2", "--node-rank", str(node_rank), "--dist-init-addr", addr)


@contextlib.contextmanager
def two_nodes(model_dir: str, log_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """Node 1 started first, then node 0, the server: yields (server handle, node 1's process)."""
    addr = f"127.0.0.1:{free_port()}"
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)
    with worker_node(model_dir, log_dir / "node1.log", *nodes_flags(addr, 1)) as node1:
        time.sleep(1.0)  # node 1 is up before node 0 and waits for it
        with start_server(model_dir, log_dir, *nodes_flags(addr, 0), timeout=180) as server:
            yield server, node1


@pytest.fixture(scope="module")
def nodes(tiny_llava_dir, tmp_path_factory):
    with (
        pytest.MonkeyPatch.context() as mp,
        two_nodes(tiny_llava_dir, tmp_path_factory.mktemp("nodes"), mp) as pair,
    ):
        yield pair


@pytest.fixture(scope="module")
def offline(tiny_llava_dir):
    return LLM(tiny_llava_dir, device="cpu", dtype="float32")


def _generate(server, text: str, seed: int | None) -> dict:
    body = {"text_input": text, "max_tokens": N, "temperature": 0, "return_log_probs": True}
    if seed is not None:
        body["image_url_input"] = image_to_data_uri(make_test_image(seed))
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _one_process(offline, text: str, seed: int | None):
    prompt = {"prompt": f"USER:\n{'<image>' if seed is not None else ''}{text} ASSISTANT:"}
    if seed is not None:
        png = base64.b64decode(image_to_data_uri(make_test_image(seed)).split(",", 1)[1])
        prompt["images"] = [png]
    params = SamplingParams(max_tokens=N, temperature=0.0, logprobs=0)
    out = offline.generate(prompt, params, use_tqdm=False)[0]
    with_prompt = offline.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True)
    return out.outputs[0], with_prompt + out.outputs[0].text


def test_two_nodes_give_one_process_tokens_and_logprobs(nodes, offline):
    server, node1 = nodes
    for text, seed in PROMPTS:
        got = _generate(server, text, seed)
        want, want_text = _one_process(offline, text, seed)
        assert got["text_output"] == want_text, (text, seed)
        logprobs = [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)]
        assert got["output_log_probs"][: len(logprobs)] == pytest.approx(logprobs, abs=1e-4)
    # token ids, through the token-level model
    ids = offline.tokenizer("Question: which city is this? Answer:").input_ids
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    got = http_infer(client, token_tensors([ids], N))["output_ids"][0, 0].tolist()
    want = offline.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=N, temperature=0.0), use_tqdm=False
    )[0]
    assert got == ids + want.outputs[0].token_ids
    assert node1.poll() is None
    log = (server.log_path.parent / "node1.log").read_text()
    assert "tp1 node1" in log and "joined the tensor-parallel group as rank 1 of 2" in log


def test_node_0_shutdown_ends_node_1_with_exit_0_from_torchrun_variables(
    tiny_llava_dir, tmp_path, offline, monkeypatch
):
    """The layout from WORLD_SIZE / RANK / MASTER_ADDR / MASTER_PORT, as torchrun sets them (no flags)."""
    port = str(free_port())
    torchrun = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    with worker_node(
        tiny_llava_dir, tmp_path / "node1.log", *TP2, env={**torchrun, "RANK": "1"}
    ) as node1:
        for name, value in {**QUIET, **torchrun, "RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        with start_server(tiny_llava_dir, tmp_path, *TP2, timeout=180) as server:
            got = _generate(server, "a cat on a mat", None)
            assert got["text_output"] == _one_process(offline, "a cat on a mat", None)[1]
            os.kill(server.proc.pid, signal.SIGTERM)  # the drain, then the engine stops the group
            assert server.proc.wait(timeout=60) == 0
        assert node1.wait(timeout=60) == 0
    log = (tmp_path / "node1.log").read_text()
    assert "the driver stopped the group; exiting" in log, log


def test_torchrun_starts_two_nodes(tiny_llava_dir, tmp_path, offline):
    """torchrun itself, one process per node (--nproc-per-node 1): its agent on node 0 hosts the rendezvous."""
    port, http_port = free_port(), free_port()
    torchrun = [
        *[str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1"],
        *["--master-addr", "127.0.0.1", "--master-port", str(port), "--node-rank"],
    ]
    tail = ["-m", "mmserve.entrypoints.cli", "serve", tiny_llava_dir, "--device", "cpu", *TP2]
    server_flags = ["--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "-1"]
    env = {**os.environ, **QUIET}
    procs = []
    try:
        for rank, extra in ((1, []), (0, server_flags)):
            with open(tmp_path / f"torchrun{rank}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        [*torchrun, str(rank), *tail, *extra],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=env,
                    )
                )
        url = f"http://127.0.0.1:{http_port}"
        deadline = time.time() + 180
        while not _ready(url):
            assert time.time() < deadline and all(p.poll() is None for p in procs), (
                tmp_path / "torchrun0.log"
            ).read_text()
            time.sleep(0.5)
        r = httpx.post(
            f"{url}/v2/models/ensemble/generate",
            json={"text_input": "two dogs in the park", "max_tokens": N, "temperature": 0},
            timeout=120,
        )
        assert r.json()["text_output"] == _one_process(offline, "two dogs in the park", None)[1]
        (server,) = _children(procs[1].pid)  # the serving process torchrun started on node 0
        os.kill(server, signal.SIGTERM)
        assert [p.wait(timeout=90) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_dead_worker_node_turns_node_0_unavailable(tiny_llava_dir, tmp_path, monkeypatch):
    """Node 1 killed under a serving node 0: the next request fails naming the lost worker, health turns 503 (an
    orchestrator restarts the group), later requests get 503 at once; node 0 keeps answering."""
    with two_nodes(tiny_llava_dir, tmp_path, monkeypatch) as (server, node1):
        assert _generate(server, "a cat", None)["text_output"]
        os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()
        body = {"text_input": "hello", "max_tokens": 4}
        r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
        assert r.status_code in (500, 503) and "tensor-parallel worker on another node" in r.text
        assert httpx.get(f"{server.http_url}/v2/health/ready", timeout=5).status_code == 503
        r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=10)
        assert r.status_code == 503 and "engine loop has stopped" in r.text, r.text
        assert server.proc.poll() is None


def test_a_dead_node_0_ends_node_1_with_exit_1(tiny_llava_dir, tmp_path, monkeypatch):
    with two_nodes(tiny_llava_dir, tmp_path, monkeypatch) as (server, node1):
        os.killpg(server.proc.pid, signal.SIGKILL)
        assert node1.wait(timeout=60) == 1
    log = (tmp_path / "node1.log").read_text()
    assert "rank 1 on node 1 lost the driver" in log and "exited with code 1" in log, log


BAD = [  # (flags, environment, the one line's start); every case: tests/unit/test_node_layout.py
    ([*TP2, "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"], {}, "--node-rank: "),
    ([*TP2, "--nnodes", "2", "--node-rank", "1"], {}, "--dist-init-addr HOST:PORT is needed"),
    ([*TP2], {"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK: "),
    ([*TP2], {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_WORLD_SIZE 2: start one mmserve"),
]


@pytest.mark.parametrize(("flags", "env", "line"), BAD)
def test_bad_node_layouts_exit_2_with_one_line(tiny_llava_dir, flags, env, line):
    proc = subprocess.run(
        serve_cmd(
            tiny_llava_dir, "--device", "cpu", "--http-port", "0", "--grpc-port", "-1", *flags
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"mmserve serve: {line}"), lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_nodes_of_one_gpu_each_over_nccl(tiny_llava_dir, tmp_path, monkeypatch):
    """Node 0 on GPU 0, node 1 on GPU 1 (CUDA_VISIBLE_DEVICES per node: each sees cuda:0), NCCL between them over
    its socket transport, as between machines (no peer-to-peer or shared memory); node 0's shutdown ends node 1."""
    addr = f"127.0.0.1:{free_port()}"
    apart = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    flags = (*nodes_flags(addr, 1), "--dtype", "float32")
    node1_env = {**apart, "CUDA_VISIBLE_DEVICES": "1"}
    with worker_node(
        tiny_llava_dir, tmp_path / "node1.log", *flags, env=node1_env, device="cuda"
    ) as node1:
        for name, value in {**apart, "CUDA_VISIBLE_DEVICES": "0"}.items():
            monkeypatch.setenv(name, value)
        server_flags = (*nodes_flags(addr, 0), "--device", "cuda", "--dtype", "float32")
        with start_server(tiny_llava_dir, tmp_path, *server_flags, timeout=300) as server:
            got = [_generate(server, text, seed) for text, seed in PROMPTS]
            os.kill(server.proc.pid, signal.SIGTERM)
            assert server.proc.wait(timeout=120) == 0
        assert node1.wait(timeout=60) == 0
    offline = LLM(tiny_llava_dir, device="cuda", dtype="float32")
    for (text, seed), answer in zip(PROMPTS, got):
        want, want_text = _one_process(offline, text, seed)
        assert answer["text_output"] == want_text
        logprobs = [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)]
        assert answer["output_log_probs"][: len(logprobs)] == pytest.approx(logprobs, abs=1e-3)
