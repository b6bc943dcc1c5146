"""The seeds' `preprocessing`, `multimodal_encoders` and `postprocessing` models against a real `mmserve serve`:
bad tensors are 400s naming the input and the limit (HTTP and gRPC), the generate extension points to infer,
requests count in the statistics extension, a gRPC stream answers each request once, and a family whose pictures
have no prompt table (Qwen2-VL) gets a 400 naming it from multimodal_encoders."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from mmserve.testing import image_to_data_uri, make_test_image
from tests.server.conftest import start_server
from tests.server.test_triton_aux_models import TEXT, infer, query, refused, strings


@pytest.fixture(scope="module")
def http(server):
    return httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))


@pytest.fixture(scope="module")
def grpc(server):
    return grpcclient.InferenceServerClient(server.grpc_url)


def test_bad_tensors_are_400s_naming_the_input(http, grpc):
    good = query(TEXT)
    pixels = np.zeros((1, 1, 3, 8, 8), np.float16)
    cases = [
        (
            "preprocessing",
            {"REQUEST_OUTPUT_LEN": good["REQUEST_OUTPUT_LEN"]},
            ["QUERY", "required"],
        ),
        (
            "preprocessing",
            {**good, "REQUEST_OUTPUT_LEN": np.array([[4.0]], np.float32)},
            ["REQUEST_OUTPUT_LEN", "INT32"],
        ),
        ("preprocessing", query(*["a"] * 65), ["QUERY", "64"]),
        (
            "preprocessing",
            {**good, "REQUEST_OUTPUT_LEN": np.array([[0]], np.int32)},
            ["REQUEST_OUTPUT_LEN", "> 0"],
        ),
        ("preprocessing", {**good, "text_input": strings(TEXT)}, ["text_input", "preprocessing"]),
        (
            "preprocessing",
            {**good, "PROMPT_TABLE_EXTRA_ID": np.array([[0]], np.uint64)},
            ["PROMPT_TABLE_EXTRA_ID", ">= 1"],
        ),
        ("preprocessing", {**good, "IMAGE_URL": strings("not a url")}, ["IMAGE_URL"]),
        ("multimodal_encoders", {"is_video_input": np.array([[False]])}, ["IMAGE", "required"]),
        (
            "multimodal_encoders",
            {"IMAGE": pixels, "max_tokens": np.array([[4]], np.int32)},
            ["max_tokens", "llava"],
        ),
        ("multimodal_encoders", {"IMAGE": pixels.astype(np.bool_)}, ["IMAGE", "FP16"]),
        ("multimodal_encoders", {"IMAGE": np.zeros((65, 1, 3, 8, 8), np.float16)}, ["IMAGE", "64"]),
        (
            "multimodal_encoders",
            {"IMAGE": np.zeros((1, 17, 3, 8, 8), np.float16)},
            ["IMAGE", "max_images_per_request"],
        ),
        (
            "multimodal_encoders",
            {"IMAGE": pixels, "pixel_values": pixels},
            ["IMAGE", "pixel_values"],
        ),
        ("multimodal_encoders", {"IMAGE": pixels}, ["IMAGE", "shape"]),
        ("multimodal_encoders", {"IMAGE": pixels[:, :, :2]}, ["IMAGE", "3 channels"]),
        (
            "postprocessing",
            {"TOKENS_BATCH": np.zeros((1, 1, 3), np.int32)},
            ["SEQUENCE_LENGTH", "required"],
        ),
        (
            "postprocessing",
            {
                "TOKENS_BATCH": np.zeros((1, 1, 3), np.int32),
                "SEQUENCE_LENGTH": np.array([[4]], np.int32),
            },
            ["SEQUENCE_LENGTH", "[0, 3]"],
        ),
        (
            "postprocessing",
            {
                "TOKENS_BATCH": np.zeros((1, 3), np.int32),
                "SEQUENCE_LENGTH": np.array([[3]], np.int32),
            },
            ["TOKENS_BATCH", "shape"],
        ),
        (
            "postprocessing",
            {
                "TOKENS_BATCH": np.full((1, 1, 3), -1, np.int32),
                "SEQUENCE_LENGTH": np.array([[3]], np.int32),
            },
            ["TOKENS_BATCH", "negative"],
        ),
    ]
    for model, tensors, words in cases:
        for client in (http, grpc):
            message = refused(client, model, tensors)
            assert all(w in message for w in words), (model, words, message)
    message = refused(http, "preprocessing", good, outputs=["DECODER_INPUT_ID"])
    assert "DECODER_INPUT_ID" in message and "not produced" in message
    message = refused(grpc, "preprocessing", good, outputs=["NOPE"])
    assert "NOPE" in message


def test_generate_extension_points_to_infer(server):
    for route in ("generate", "generate_stream"):
        resp = httpx.post(
            f"{server.http_url}/v2/models/preprocessing/{route}",
            json={"QUERY": TEXT, "REQUEST_OUTPUT_LEN": 4},
        )
        assert resp.status_code == 400 and "infer" in resp.json()["error"]


def test_counted_in_statistics_and_answered_on_a_grpc_stream(http, grpc):
    before = http.get_inference_statistics("postprocessing")["model_stats"][0]
    tensors = {
        "TOKENS_BATCH": np.array([[[5, 6, 7]]], np.int32),
        "SEQUENCE_LENGTH": np.array([[3]], np.int32),
    }
    want = infer(http, "postprocessing", tensors)["OUTPUT"].tolist()
    results = []
    grpc.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        inputs = []
        for name, arr in tensors.items():
            inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        grpc.async_stream_infer("postprocessing", inputs, request_id="s1")
        grpc.async_stream_infer("postprocessing", inputs[:1], request_id="s2")
    finally:
        grpc.stop_stream()
    by_id = {(r.get_response().id if r else e.message()): (r, e) for r, e in results}
    ok = next(r for r, e in results if r is not None)
    assert ok.as_numpy("OUTPUT").tolist() == want and ok.get_response().id == "s1"
    assert ok.get_response().parameters["triton_final_response"].bool_param
    assert any(e is not None and "SEQUENCE_LENGTH" in e.message() for _, e in results), by_id
    after = http.get_inference_statistics("postprocessing")["model_stats"][0]
    assert after["inference_count"] == before["inference_count"] + 2
    assert (
        int(after["inference_stats"]["success"]["count"])
        == int(before["inference_stats"]["success"]["count"]) + 2
    )


# ---- a family without a prompt table ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_vl_server(tmp_path_factory):
    from mmserve.testing.qwen2_vl import make_qwen2_vl_checkpoint

    model_dir = make_qwen2_vl_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen2_vl_aux"), preset="tiny"
    )
    with start_server(str(model_dir), tmp_path_factory.mktemp("qwen2-vl-aux-logs")) as handle:
        yield handle


def test_multimodal_encoders_refuses_a_family_without_a_table(qwen2_vl_server):
    """Qwen2-VL's pictures take M-RoPE positions from their grids: no table to hand out (a 400 naming the
    family); its preprocessing keeps the processor's placeholder ids."""
    http = httpclient.InferenceServerClient(qwen2_vl_server.http_url.removeprefix("http://"))
    grpc = grpcclient.InferenceServerClient(qwen2_vl_server.grpc_url)
    for client in (http, grpc):
        message = refused(
            client, "multimodal_encoders", {"IMAGE": np.zeros((1, 1, 3, 28, 28), np.float16)}
        )
        assert "qwen2_vl" in message and "prompt embedding table" in message
    config = json.loads((Path(qwen2_vl_server.model_dir) / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    pre = infer(
        http, "preprocessing", query(TEXT, IMAGE_URL=strings(image_to_data_uri(make_test_image(2))))
    )
    ids = pre["INPUT_ID"][0].tolist()
    assert max(ids) < vocab and ids.count(config["image_token_id"]) > 0
    assert "PIXEL_VALUES" not in pre  # its pixels are flattened patches, not [3, H, W] pictures
