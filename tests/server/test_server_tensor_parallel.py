"""`mmserve serve --tensor-parallel-size 2`: a real server whose language model is sharded over two processes
answers Triton requests (text, and an image over gRPC with tritonclient) as the one-process offline LLM does; a
worker that dies turns the server unavailable (health 503, requests 503) instead of hanging."""

from __future__ import annotations

import os
import signal

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from tests.server.conftest import ensemble_texts, start_server
from tests.server.test_triton_grpc import TEXT, completion, seed_inputs

PROMPTS = ["a cat on a mat", "two dogs in the park"]


@pytest.fixture(scope="module")
def tp_server(tiny_llava_dir, tmp_path_factory):
    with start_server(
        tiny_llava_dir, tmp_path_factory.mktemp("tp-logs"), "--tensor-parallel-size", "2"
    ) as handle:
        yield handle


def test_sharded_server_answers_as_one_process(tp_server, tiny_llava_dir):
    got = ensemble_texts(tp_server, PROMPTS, max_tokens=10)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    offline = LLM(tiny_llava_dir, device="cpu").generate(
        [f"USER:\n{t} ASSISTANT:" for t in PROMPTS], params, use_tqdm=False
    )
    assert [g.endswith(o.outputs[0].text) for g, o in zip(got, offline)] == [True, True]


def test_sharded_server_answers_an_image_over_grpc(tp_server, tiny_llava_dir):
    image = np.asarray(make_test_image(6, size=(30, 20)))[None, None]  # [1, 1, H, W, 3] uint8
    _, want = completion(
        LLM(tiny_llava_dir, device="cpu"),
        {"prompt": f"USER:\n<image>{TEXT} ASSISTANT:", "images": [make_test_image(6, (30, 20))]},
        max_tokens=16,
        top_k=1,
    )
    with grpcclient.InferenceServerClient(tp_server.grpc_url) as client:
        for model in ("ensemble", "tensorrt_llm_bls"):
            assert (
                client.infer(model, seed_inputs("image_bytes_input", image))
                .as_numpy("text_output")[0]
                .decode()
                == want
            )


def _spawned_children(pid: int) -> list[int]:
    """Processes whose parent is `pid` and that multiprocessing spawned (the tensor-parallel workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def test_a_dead_worker_turns_the_server_unavailable(tiny_llava_dir, tmp_path):
    """A worker killed under a running server: the next request fails naming it, health turns 503 (so an
    orchestrator restarts the server) and later requests get 503 at once instead of waiting on a collective."""
    with start_server(tiny_llava_dir, tmp_path, "--tensor-parallel-size", "2") as server:
        assert ensemble_texts(server, PROMPTS[:1], max_tokens=4)
        (worker,) = _spawned_children(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        body = {"text_input": "hello", "max_tokens": 4}
        r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
        assert r.status_code in (500, 503) and "tensor-parallel worker 1" in r.text, r.text
        assert httpx.get(f"{server.http_url}/v2/health/ready", timeout=5).status_code == 503
        r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=10)
        assert r.status_code == 503 and "engine loop has stopped" in r.text, r.text
        assert server.proc.poll() is None  # still answering, with 503s
