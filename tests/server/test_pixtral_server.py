"""A real server on a tiny Pixtral checkpoint (a LLaVA config with Pixtral's tower: Triton model type `pixtral`):
the `ensemble` builds its prompt as TensorRT-LLM's pixtral preprocessing does (the raw text, `[IMG]` per picture in
front), from an image URL and from zero-padded `image_bytes_input` with `image_sizes_input` (what the seeds'
client sends for --model_type pixtral), answered as transformers answers the same prompt."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from mmserve.testing import image_to_data_uri, make_checkpoint, make_test_image
from tests.parity.hf_oracle import _load
from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def pixtral(tmp_path_factory):
    model_dir = str(
        make_checkpoint("pixtral", tmp_path_factory.mktemp("tiny_pixtral_server"), preset="tiny")
    )
    with start_server(model_dir, tmp_path_factory.mktemp("pixtral-logs")) as handle:
        yield model_dir, handle


def _hf_completion(model_dir: str, prompt: str, images: list, n: int) -> str:
    model, processor = _load(model_dir, "cpu")
    enc = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_ensemble_prompts_as_tensorrt_llms_pixtral_preprocessing(pixtral):
    model_dir, server = pixtral
    text = "What is in the picture?"
    image = make_test_image(3, (48, 32))
    body = {
        "text_input": text,
        "max_tokens": 10,
        "temperature": 0,
        "image_url_input": image_to_data_uri(image),
        "exclude_input_in_output": True,
    }
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == _hf_completion(model_dir, "[IMG]" + text, [image], 10)

    small, large = make_test_image(4, (32, 16)), make_test_image(5, (48, 48))
    padded = np.zeros((2, 48, 48, 3), np.uint8)
    padded[0, :16, :32], padded[1] = np.asarray(small), np.asarray(large)
    tensors = {
        "text_input": np.array([[b"Compare them."]], dtype=object),
        "max_tokens": np.array([[10]], np.int32),
        "temperature": np.array([[0.0]], np.float32),
        "image_bytes_input": padded[None],
        "image_sizes_input": np.array([[[16, 32], [48, 48]]], np.int64),
        "exclude_input_in_output": np.array([[True]]),
    }
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    inputs = []
    for name, arr in tensors.items():
        inp = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    got = client.infer("ensemble", inputs).as_numpy("text_output")[0].decode()
    assert got == _hf_completion(model_dir, "[IMG][IMG]Compare them.", [small, large], 10)
