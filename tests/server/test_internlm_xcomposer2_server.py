"""A real server on a tiny InternLM-XComposer2 checkpoint, driven as the seed's client (`tools/internlm_xcomposer2/
client.py`) drives the `ensemble` over gRPC: the full prompt template in `text_input`, the picture preprocessed as
FP16 `image_input` [1, 3, H, W], and the Partial LoRA sent as a LoRA task (`lora_task_id` with `lora_weights` +
`lora_config` the first time, the task id alone after). Those answers equal the plain checkpoint's (its own Partial
LoRA, nothing sent) and the offline API's; an OpenAI chat follows the original chat template."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from openai import OpenAI
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve import LLM, SamplingParams
from mmserve.testing import image_to_data_uri, make_test_image
from mmserve.testing.internlm_xcomposer2 import (
    make_internlm_xcomposer2_checkpoint,
    write_xcomposer2_lora_task,
)
from tests.parity.xcomposer2_reference import preprocess
from tests.server.conftest import start_server

N = 10
PICTURE = make_test_image(41, (40, 30))
S = (
    "[UNUSED_TOKEN_146]system\nYou are an AI assistant whose name is InternLM-XComposer (浦语·灵笔)."
    "[UNUSED_TOKEN_145]\n"
)
TEXT = (
    S
    + "[UNUSED_TOKEN_146]user\n<ImageHere>Please describe this image in detail.[UNUSED_TOKEN_145]\n"
)
TEXT += "[UNUSED_TOKEN_146]assistant\n"


def _fp16_exact_plora(model_dir: Path) -> None:
    """Round the checkpoint's Partial LoRA to fp16 values: the LoRA task's FP16 wire format then loses nothing."""
    for shard in model_dir.glob("pytorch_model-*.bin"):
        tensors = torch.load(shard, weights_only=True)
        torch.save(
            {k: v.half().float() if ".Plora_" in k else v for k, v in tensors.items()}, shard
        )


@pytest.fixture(scope="module")
def xc(tmp_path_factory):
    model_dir = make_internlm_xcomposer2_checkpoint(tmp_path_factory.mktemp("xc_server"))
    _fp16_exact_plora(model_dir)
    task = write_xcomposer2_lora_task(model_dir, tmp_path_factory.mktemp("xc_task"))
    with start_server(str(model_dir), tmp_path_factory.mktemp("xc-logs")) as handle:
        yield handle, LLM(str(model_dir), device="cpu"), task


def _infer(server, task_id: int | None, task_dir: Path | None = None) -> str:
    pixels = (
        preprocess(PICTURE, 28)[None].numpy().astype(np.float16)
    )  # [1, 3, 28, 28], as the seed sends
    arrays = {
        "text_input": np.array([[TEXT.encode()]], dtype=object),
        "max_tokens": np.array([[N]], np.int32),
        "beam_width": np.array([[1]], np.int32),
        "temperature": np.array([[0.0]], np.float32),
        "top_k": np.array([[1]], np.int32),
        "top_p": np.array([[0.0]], np.float32),
        "return_log_probs": np.array([[False]]),
        "image_input": pixels,
    }
    if task_id is not None:
        arrays["lora_task_id"] = np.array([[task_id]], np.uint64)
    if task_dir is not None:
        arrays["lora_weights"] = np.load(task_dir / "model.lora_weights.npy")
        arrays["lora_config"] = np.load(task_dir / "model.lora_config.npy")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, arr in arrays.items():
        inputs.append(grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype)))
        inputs[-1].set_data_from_numpy(arr)
    out = client.infer("ensemble", inputs).as_numpy("text_output")
    return out.reshape(-1)[0].decode()


def test_the_seeds_lora_task_flow_answers_as_the_checkpoint(xc):
    server, offline, task = xc
    first = _infer(server, 1, task)  # the adapter sent with the task's first request
    cached = _infer(server, 1)  # then the task id alone
    plain = _infer(server, None)  # the checkpoint's own Partial LoRA
    pixels = torch.from_numpy(preprocess(PICTURE, 28)[None].numpy().astype(np.float16)).float()
    expected = (
        offline.generate(
            {"prompt": TEXT, "pixel_values": pixels},
            SamplingParams(max_tokens=N, temperature=0.0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert first.endswith(expected) and cached == first and plain == first


def test_openai_chat_follows_the_original_template(xc):
    server, offline, _ = xc
    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="x")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_to_data_uri(PICTURE)}},
                {"type": "text", "text": "Please describe this image in detail."},
            ],
        }
    ]
    got = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=N, temperature=0
    )
    chat = offline.chat(messages, SamplingParams(max_tokens=N, temperature=0.0), use_tqdm=False)[0]
    assert chat.prompt == TEXT
    assert got.choices[0].message.content == chat.outputs[0].text


def test_a_sent_task_replaces_the_built_in_partial_lora(xc, tmp_path):
    """A task whose deltas are all zero answers as the checkpoint without its Partial LoRA: the sent adapter takes
    the built-in one's place on the picture rows (not both, not neither)."""
    import shutil

    server, _, task = xc
    zero = tmp_path / "zero"
    shutil.copytree(task, zero)
    np.save(
        zero / "model.lora_weights.npy", np.zeros_like(np.load(task / "model.lora_weights.npy"))
    )
    with_zero_task = _infer(server, 2, zero)
    bare = tmp_path / "bare"
    shutil.copytree(server.model_dir, bare)
    for shard in bare.glob("pytorch_model-*.bin"):
        tensors = torch.load(shard, weights_only=True)
        torch.save({k: v for k, v in tensors.items() if ".Plora_" not in k}, shard)
    index = json.loads((bare / "pytorch_model.bin.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".Plora_" not in k}
    (bare / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    pixels = torch.from_numpy(preprocess(PICTURE, 28)[None].numpy().astype(np.float16)).float()
    without = LLM(str(bare), device="cpu").generate(
        {"prompt": TEXT, "pixel_values": pixels},
        SamplingParams(max_tokens=N, temperature=0.0),
        use_tqdm=False,
    )[0]
    assert with_zero_task.endswith(without.outputs[0].text)
    assert with_zero_task != _infer(server, None)


def test_a_picture_of_the_wrong_size_is_a_400_naming_it(xc):
    server, _, _ = xc
    client = grpcclient.InferenceServerClient(server.grpc_url)
    arrays = {
        "text_input": np.array([[TEXT.encode()]], dtype=object),
        "max_tokens": np.array([[4]], np.int32),
        "image_input": np.zeros((1, 3, 20, 20), np.float16),  # the tower takes 28 px
    }
    inputs = []
    for name, arr in arrays.items():
        inputs.append(grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype)))
        inputs[-1].set_data_from_numpy(arr)
    with pytest.raises(InferenceServerException, match="image_input.*28, 28"):
        client.infer("ensemble", inputs)
    assert _infer(server, None)  # the server keeps serving
