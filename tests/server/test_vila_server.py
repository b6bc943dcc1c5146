"""A real server on a tiny VILA 1.5 checkpoint (published layout): the seeds' client command (`--model_type vila`
with two pictures, preprocessed FP16 `image_input` from `--hf_model_dir`), the Triton `ensemble` prompt format,
an OpenAI chat with two pictures, and bad input answered with a 4xx while the server keeps serving."""

from __future__ import annotations

import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from openai import OpenAI
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.triton.prompts import build_prompt
from mmserve.testing import image_to_data_uri, image_to_png_bytes, make_test_image
from mmserve.testing.vila import make_vila_checkpoint
from tests.parity.vila_reference import _load, process_image
from tests.server.conftest import start_server
from tests.server.test_client_cli import printed_text

TEXT = "<image>\n<image>\n Please elaborate what you see in the images?"  # the seeds' example
PICTURES = [make_test_image(21, (48, 40)), make_test_image(22, (40, 56))]
N = 10


@pytest.fixture(scope="module")
def vila(tmp_path_factory):
    model_dir = str(make_vila_checkpoint(tmp_path_factory.mktemp("vila_server")))
    with start_server(model_dir, tmp_path_factory.mktemp("vila-logs")) as handle:
        yield model_dir, handle, LLM(model_dir, device="cpu")


def _offline(llm: LLM, prompt: dict) -> str:
    params = SamplingParams(max_tokens=N, temperature=0.0)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def test_the_seeds_client_with_two_preprocessed_pictures(vila, tmp_path):
    model_dir, server, offline = vila
    paths = []
    for k, im in enumerate(PICTURES):
        paths.append(tmp_path / f"{k}.png")
        paths[-1].write_bytes(image_to_png_bytes(im))
    cmd = [sys.executable, "-m", "mmserve.entrypoints.cli", "client", "--url", server.grpc_url]
    cmd += ["--model_type", "vila", "--hf_model_dir", model_dir, "--text", TEXT]
    cmd += ["--image", ",".join(map(str, paths)), "--request-output-len", str(N)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    processor = _load(model_dir, "cpu").processor
    pixels = torch.stack([process_image(im, processor, "resize") for im in PICTURES])
    fp16 = pixels.half().float()  # what the client sends
    prompt = build_prompt("vila", TEXT, 2)
    assert prompt.startswith("A chat between a curious user") and prompt.endswith(" ASSISTANT:")
    expected = _offline(offline, {"prompt": prompt, "pixel_values": fp16})
    assert printed_text(proc.stdout, False).endswith(expected)


def test_ensemble_adds_the_placeholders_and_template(vila):
    _, server, offline = vila
    body = {
        "text_input": "What differs?",
        "max_tokens": N,
        "temperature": 0,
        "image_url_input": [image_to_data_uri(im) for im in PICTURES],
        "exclude_input_in_output": True,
    }
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    prompt = build_prompt("vila", "What differs?", 2)
    assert prompt.count("<image>") == 2
    assert r.json()["text_output"] == _offline(offline, {"prompt": prompt, "images": PICTURES})


def test_openai_chat_with_two_pictures(vila):
    _, server, offline = vila
    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="x")
    content = [
        {"type": "image_url", "image_url": {"url": image_to_data_uri(im)}} for im in PICTURES
    ]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "Compare them."}]}]
    got = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=N, temperature=0
    )
    params = SamplingParams(max_tokens=N, temperature=0.0)
    expected = offline.chat(messages, params, use_tqdm=False)[0]
    assert got.choices[0].message.content == expected.outputs[0].text
    assert expected.prompt_token_ids[:1] == [1]  # BOS, then the vicuna system line
    assert expected.prompt.startswith("A chat between a curious user")


def test_bad_input_is_a_4xx_and_the_server_keeps_serving(vila):
    _, server, _ = vila
    body = {
        "text_input": "<image>\nonly one placeholder",
        "max_tokens": 4,
        "image_url_input": [image_to_data_uri(im) for im in PICTURES],
    }
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
    assert r.status_code == 400 and "placeholder" in r.text, r.text
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    inputs = []
    tensors = {
        "text_input": np.array([[b"<image>\n<image>\nHi"]], dtype=object),
        "max_tokens": np.array([[4]], np.int32),
        "image_input": np.zeros((1, 2, 3, 20, 20), np.float16),  # the tower takes 42 px
    }
    for name, arr in tensors.items():
        inputs.append(httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype)))
        inputs[-1].set_data_from_numpy(arr)
    with pytest.raises(InferenceServerException, match="42"):
        client.infer("ensemble", inputs)
    ok = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate",
        json={"text_input": "Hi", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
