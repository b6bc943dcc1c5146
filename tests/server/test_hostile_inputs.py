"""What fuzzing a running server found (issue 30), each against a real server: a very thin picture is refused before
any resizing, over every way a picture arrives; deeply nested JSON is a 400 on every route; NaN sampling
parameters are refused over Triton HTTP, OpenAI and gRPC; non-finite log-probs keep the answer valid JSON,
streamed or not. Every refusal leaves the keep-alive connection serving the client's next request."""

from __future__ import annotations

import http.client
import io
import json
import math

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from PIL import Image
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve.testing import image_to_data_uri, make_test_image
from tests.conftest import strict_json
from tests.server.conftest import serve_with, start_server

THIN = Image.new("RGB", (400000, 1))  # 1.2 KB as a PNG; resized to a 336-px short edge it is 135 GB
GOOD = {"text_input": "Is this fine?", "max_tokens": 4, "temperature": 0}


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


class KeepAlive:
    """One HTTP/1.1 connection: each request must be answered on it, and the server must keep it open."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.local = None

    def post(self, path: str, body: bytes | str | dict) -> tuple[int, str]:
        data = json.dumps(body) if isinstance(body, dict) else body
        self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        text = response.read().decode()
        assert not response.will_close, (
            f"the server closed the connection after {response.status}: {text[:200]}"
        )
        local = self.conn.sock.getsockname()
        assert self.local in (None, local), "the client had to reconnect"
        self.local = local
        return response.status, text

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def keepalive(server):
    conn = KeepAlive(server.http_url)
    yield conn
    conn.close()


def _model(server) -> str:
    return httpx.get(f"{server.http_url}/v1/models").json()["data"][0]["id"]


# ---- 1. a very thin picture ------------------------------------------------------------------------


def test_thin_picture_refused_over_http_before_resizing(server, keepalive, media_server):
    base_url, root = media_server
    (root / "thin.png").write_bytes(_png(THIN))
    data_uri = image_to_data_uri(THIN)
    for source in (data_uri, f"{base_url}/thin.png"):
        status, text = keepalive.post(
            "/v2/models/ensemble/generate", {**GOOD, "image_url_input": source}
        )
        assert (
            status == 400 and "image_url_input[0]" in text and "max_image_aspect_ratio=200" in text
        ), text
    chat = {
        "model": _model(server),
        "max_tokens": 2,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_uri}},
                    {"type": "text", "text": "what?"},
                ],
            }
        ],
    }
    status, text = keepalive.post("/v1/chat/completions", chat)
    assert status == 400 and "max_image_aspect_ratio=200" in text, text
    assert json.loads(text)["error"]["param"] == "messages"
    status, text = keepalive.post("/v2/models/ensemble/generate", GOOD)
    assert status == 200, text


def test_thin_picture_refused_over_grpc_tensors(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    pixels = np.zeros((1, 1, 1, 400000, 3), np.uint8)  # [batch, images, H, W, C]
    inputs = []
    for name, value in [
        ("text_input", np.array([["<image>what?"]], dtype=object)),
        ("max_tokens", np.array([[2]], np.int32)),
        ("image_bytes_input", pixels),
    ]:
        inputs.append(
            grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        )
        inputs[-1].set_data_from_numpy(value)
    with pytest.raises(InferenceServerException) as info:
        client.infer("tensorrt_llm_bls", inputs)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert (
        "image_bytes_input" in info.value.message()
        and "max_image_aspect_ratio" in info.value.message()
    )


# ---- 2. non-finite log-probs -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_masked_top_logprobs_are_finite_json(server, stream):
    """A JSON guide masks all but a few tokens, so a top-2 list holds a -inf log-prob: the answer stays strict
    JSON, with the same (finite) number whether streamed or not."""
    body = {
        "model": _model(server),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "logprobs": True,
        "top_logprobs": 2,
        "stream": stream,
    }
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [strict_json(e) for e in events[:-1]]
        entries = [
            entry
            for c in chunks
            for choice in c["choices"]
            for entry in ((choice.get("logprobs") or {}).get("content") or [])
        ]
    else:
        entries = strict_json(r.text)["choices"][0]["logprobs"]["content"]
    tops = [top["logprob"] for entry in entries for top in entry["top_logprobs"]]
    assert tops and all(isinstance(v, float) and math.isfinite(v) for v in tops), tops
    assert (
        min(tops) == -3.4028234663852886e38
    )  # the first token: "{" is the only one the guide allows


# ---- 3. deeply nested JSON ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/tokenize",
        "/detokenize",
        "/v2/models/ensemble/generate",
        "/v2/models/ensemble/infer",
    ],
)
def test_deeply_nested_json_is_a_400(keepalive, path):
    status, text = keepalive.post(path, "[" * 100000 + "]" * 100000)
    assert status == 400, text
    message = json.loads(text)["error"]
    message = message["message"] if isinstance(message, dict) else message
    assert "nested too deeply" in message
    status, text = keepalive.post("/v2/models/ensemble/generate", GOOD)
    assert status == 200, text


# ---- 4. NaN sampling parameters ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "repetition_penalty",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "length_penalty",
    ],
)
def test_nan_sampling_parameters_over_triton_http(keepalive, field):
    body = {**GOOD, field: float("nan")}
    if field == "length_penalty":
        body["beam_width"] = 2
    status, text = keepalive.post("/v2/models/ensemble/generate", json.dumps(body))  # writes NaN
    assert status == 400 and field in json.loads(text)["error"] and "finite" in text, text


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
    ],
)
def test_nan_sampling_parameters_over_openai(server, keepalive, field):
    # the openai SDK will not write NaN; other clients (and Python's json) do
    body = json.dumps(
        {"model": _model(server), "prompt": "hi", "max_tokens": 2, field: float("nan")}
    )
    status, text = keepalive.post("/v1/completions", body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == field and "finite" in error["message"], text


def test_nan_sampling_parameters_over_grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for name in ("temperature", "repetition_penalty"):
        inputs = []
        for key, value in [
            ("text_input", np.array([["hi"]], dtype=object)),
            ("max_tokens", np.array([[2]], np.int32)),
            (name, np.array([[np.nan]], np.float32)),
        ]:
            inputs.append(
                grpcclient.InferInput(key, list(value.shape), np_to_triton_dtype(value.dtype))
            )
            inputs[-1].set_data_from_numpy(value)
        with pytest.raises(InferenceServerException) as info:
            client.infer("ensemble", inputs)
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and name in info.value.message()
    inputs[-1].set_data_from_numpy(np.array([[1.0]], np.float32))
    assert client.infer("ensemble", inputs).as_numpy("text_output") is not None


def test_a_good_picture_still_passes(keepalive):
    body = {
        **GOOD,
        "text_input": "<image>what?",
        "image_url_input": image_to_data_uri(make_test_image(3)),
    }
    status, text = keepalive.post("/v2/models/ensemble/generate", body)
    assert status == 200, text


def test_limit_flags(tiny_llava_dir, tmp_path):
    for flag, value, message in [
        ("--max-image-aspect-ratio", "0.5", "max_image_aspect_ratio must be a finite number"),
        ("--max-stop-sequences", "0", "max_stop_sequences"),
    ]:
        bad = serve_with(tiny_llava_dir, flag, value)
        assert bad.returncode != 0 and message in bad.stderr and "Traceback" not in bad.stderr, (
            bad.stderr
        )
    with start_server(
        tiny_llava_dir, tmp_path, "--max-image-aspect-ratio", "2", "--max-media-bytes", "4096"
    ) as srv:
        conn = KeepAlive(srv.http_url)
        wide = {
            **GOOD,
            "text_input": "<image>what?",
            "image_url_input": image_to_data_uri(Image.new("RGB", (30, 10))),
        }
        status, text = conn.post("/v2/models/ensemble/generate", wide)
        assert (
            status == 400 and "30x10 pixels, an aspect ratio above max_image_aspect_ratio=2" in text
        ), text
        noisy = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), np.uint8))
        status, text = conn.post(
            "/v2/models/ensemble/generate", {**wide, "image_url_input": image_to_data_uri(noisy)}
        )
        assert status == 400 and "max_media_bytes=4096" in text, text
        square = {**wide, "image_url_input": image_to_data_uri(Image.new("RGB", (20, 10)))}
        assert conn.post("/v2/models/ensemble/generate", square)[0] == 200
        conn.close()


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": 5}}, "response_format"),
        ({"top_k": 10**23}, "top_k"),
        ({"seed": 10**23}, "seed"),
    ],
)
def test_out_of_range_openai_values_are_400s_and_others_keep_running(
    server, keepalive, extra, param
):
    """Edge values that once reached the engine (a top_k past int64 failed the whole step it ran in)."""
    body = {
        "model": _model(server),
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }
    status, text = keepalive.post("/v1/chat/completions", body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == param, text
    status, text = keepalive.post("/v2/models/ensemble/generate", GOOD)
    assert status == 200, text
