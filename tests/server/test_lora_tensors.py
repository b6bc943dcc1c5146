"""The seeds' Triton LoRA flow against a real `mmserve serve`: the first request of a task sends the adapter as
TensorRT-LLM tensors (lora_task_id + lora_weights + lora_config), later ones send lora_task_id alone; tritonclient
(HTTP, binary FP16), the generate endpoint (JSON arrays) and `mmserve client --lora-path` (gRPC) all reach the
same deltas as the PEFT adapter loaded at startup; refusals name the tensor; a full cache evicts the least recently
used task no request holds."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch
import tritonclient.http as httpclient
from safetensors.torch import load_file, save_file
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve.testing import image_to_data_uri, make_test_image
from mmserve.testing.lora import make_lora_adapter, trtllm_lora_tensors
from tests.server.conftest import start_server

TEXT = "USER: tell me a story ASSISTANT:"


def _fp16_exact_adapter(path, model_dir, **kw) -> str:
    """A PEFT adapter whose A, B and scaling (alpha / r = 2) are exact in fp16: the FP16 wire format loses nothing."""
    out = make_lora_adapter(path, model_dir, **kw)
    file = out / "adapter_model.safetensors"
    save_file({k: v.half().float() for k, v in load_file(str(file)).items()}, str(file))
    return str(out)


@pytest.fixture(scope="module")
def adapters(tiny_llava_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_tensors")
    return {
        "alpha": _fp16_exact_adapter(root / "alpha", tiny_llava_dir, seed=1, alpha=8.0),
        "beta": _fp16_exact_adapter(
            root / "beta",
            tiny_llava_dir,
            seed=2,
            alpha=8.0,
            targets=("q_proj", "v_proj", "down_proj"),
        ),
    }


def _infer(
    client, task: int, weights: np.ndarray | None = None, config: np.ndarray | None = None
) -> str:
    arrays = {
        "text_input": np.array([[TEXT.encode()]], dtype=np.object_),
        "max_tokens": np.array([[8]], dtype=np.int32),
        "temperature": np.array([[0.0]], dtype=np.float32),
        "exclude_input_in_output": np.array([[True]]),
        "lora_task_id": np.array([[task]], dtype=np.uint64),
    }
    if weights is not None:
        arrays["lora_weights"], arrays["lora_config"] = weights[None], config[None]
    inputs = []
    for name, arr in arrays.items():
        inp = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr, binary_data=True)
        inputs.append(inp)
    result = client.infer(
        "tensorrt_llm_bls", inputs, outputs=[httpclient.InferRequestedOutput("text_output")]
    )
    return result.as_numpy("text_output").reshape(-1)[0].decode()


def test_adapters_sent_with_requests_are_cached_by_task_id(tiny_llava_dir, adapters, tmp_path):
    alpha_w, alpha_c = (t.numpy() for t in trtllm_lora_tensors(adapters["alpha"], torch.float16))
    beta_w, beta_c = (t.numpy() for t in trtllm_lora_tensors(adapters["beta"], torch.float16))
    with start_server(
        tiny_llava_dir,
        tmp_path,
        "--lora-modules",
        f"alpha={adapters['alpha']}",
        f"beta={adapters['beta']}",
        "--max-loras",
        "4",
    ) as server:
        oai = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
        want = {
            n: oai.completions.create(model=n, prompt=TEXT, max_tokens=8, temperature=0)
            .choices[0]
            .text
            for n in ("alpha", "beta", server.model_dir.rstrip("/").rsplit("/", 1)[-1])
        }
        assert want["alpha"] != want["beta"]
        client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
        assert _infer(client, 11, alpha_w, alpha_c) == want["alpha"]  # sent once ...
        assert _infer(client, 11) == want["alpha"]  # ... then named alone
        assert _infer(client, 11, alpha_w, alpha_c) == want["alpha"]  # the same weights again: fine

        def refused(task: int, weights, config, message: str) -> None:
            with pytest.raises(InferenceServerException, match=message):
                _infer(client, task, weights, config)

        refused(11, beta_w, beta_c, "lora_weights: LoRA task 11 is loaded with other weights")
        bad = alpha_c.copy()
        bad[0, 0] = 9
        refused(12, alpha_w, bad, r"lora_config row 0 \(module 9, .*module id 9 is not supported")
        refused(12, alpha_w[:, :5], alpha_c, "lora_weights row 0: .* needs")
        refused(12, None, None, "lora_task_id: LoRA task 12 is not loaded")
        # the generate endpoint carries JSON arrays: lora_weights arrives as one row and is split by lora_config
        body = {
            "text_input": TEXT,
            "max_tokens": 8,
            "temperature": 0,
            "exclude_input_in_output": True,
            "lora_task_id": 12,
            "lora_weights": alpha_w.reshape(-1).astype(float).tolist(),
            "lora_config": alpha_c.reshape(-1).tolist(),
        }
        r = httpx.post(
            f"{server.http_url}/v2/models/tensorrt_llm_bls/generate", json=body, timeout=60
        )
        assert r.status_code == 200 and r.json()["text_output"] == want["alpha"], r.text
        r = httpx.post(
            f"{server.http_url}/v2/models/tensorrt_llm_bls/generate",
            json={**body, "lora_task_id": 13, "lora_config": []},
            timeout=60,
        )
        assert r.status_code == 400 and "lora_config: missing" in r.text
        # four slots: alpha and beta (startup, never evicted) and two tasks; 11 is used last, 12 before it
        assert _infer(client, 11) == want["alpha"]
        # the seeds' client: --lora-path with hf_lora_convert.py's files, over gRPC; 13 replaces 12
        lora_dir = tmp_path / "beta-weights"
        lora_dir.mkdir()
        np.save(lora_dir / "model.lora_weights.npy", beta_w[None])
        np.save(lora_dir / "model.lora_config.npy", beta_c[None])
        image = tmp_path / "page.png"
        make_test_image(5).save(image)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mmserve.entrypoints.cli",
                "client",
                "--url",
                server.grpc_url,
                "--model_type",
                "llava",
                "--use_bls",
                "--image",
                str(image),
                "--text",
                TEXT,
                "--request-output-len",
                "8",
                "--lora-task-id",
                "13",
                "--lora-path",
                str(lora_dir),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        printed = proc.stdout.split("[beam 0 ]:\n", 1)[1].rsplit("\n[INFO]", 1)[0]
        same = httpx.post(
            f"{server.http_url}/v2/models/tensorrt_llm_bls/generate",
            timeout=60,
            json={
                "text_input": TEXT,
                "max_tokens": 8,
                "top_k": 1,
                "lora_task_id": 13,
                "image_url_input": image_to_data_uri(make_test_image(5)),
            },
        )
        assert same.status_code == 200 and printed == same.json()["text_output"]
        assert _infer(client, 13) == want["beta"]
        with pytest.raises(
            InferenceServerException, match="lora_task_id: LoRA task 12 is not loaded"
        ):
            _infer(client, 12)  # the least recently used task made room for 13
        assert _infer(client, 11) == want["alpha"]
        names = {m.id for m in oai.models.list().data}
        assert {"alpha", "beta", "11", "13"} <= names and "12" not in names
