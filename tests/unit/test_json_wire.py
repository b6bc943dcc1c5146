"""The JSON rules of every HTTP response and request body (mmserve/entrypoints/json_wire.py), and the Triton
encoders that use them: non-finite floats become strict JSON, nesting too deep is a ValueError naming the body."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from mmserve.entrypoints.json_wire import (
    FLOAT32_MAX,
    WireJSONResponse,
    dumps,
    json_float,
    loads_object,
)
from mmserve.entrypoints.openai.protocol import CompletionLogprobs, TokenLogprob, TopLogprob
from mmserve.entrypoints.triton import http as triton_http
from tests.conftest import strict_json


def test_json_float_rule():
    assert json_float(-1.5) == -1.5
    assert json_float(float("-inf")) == -FLOAT32_MAX and json_float(float("inf")) == FLOAT32_MAX
    assert json_float(float("nan")) is None
    assert FLOAT32_MAX == float(np.finfo(np.float32).max)


def test_dumps_writes_strict_json_for_any_document():
    doc = {"a": [1.0, float("-inf"), {"b": float("nan")}], "c": (float("inf"),), "d": "text"}
    assert strict_json(dumps(doc)) == {
        "a": [1.0, -FLOAT32_MAX, {"b": None}],
        "c": [FLOAT32_MAX],
        "d": "text",
    }
    assert dumps({"x": 1}) == b'{"x":1}'
    response = WireJSONResponse({"logprob": float("-inf")})
    assert strict_json(response.body) == {"logprob": -FLOAT32_MAX}


def test_openai_models_follow_the_same_rule_streamed_or_not():
    entry = TokenLogprob(
        token="a", logprob=float("-inf"), top_logprobs=[TopLogprob(token="b", logprob=float("nan"))]
    )
    for text in (
        entry.model_dump_json(),
        json.dumps(entry.model_dump(mode="json"), allow_nan=False),
    ):
        assert (
            strict_json(text)["logprob"] == -FLOAT32_MAX
            and strict_json(text)["top_logprobs"][0]["logprob"] is None
        )
    logprobs = CompletionLogprobs(
        tokens=["a"], token_logprobs=[float("-inf")], top_logprobs=[{"a": float("inf")}]
    )
    assert strict_json(logprobs.model_dump_json())["top_logprobs"] == [{"a": FLOAT32_MAX}]
    assert entry.model_dump()["logprob"] == float("-inf")  # in Python the value itself stays


def test_triton_json_encodings_of_non_finite_tensors():
    logits = np.array([[0.5, -np.inf, np.nan]], np.float32)
    body = strict_json(triton_http._generate_json("ensemble", "", {"generation_logits": logits}))
    assert body["generation_logits"] == [0.5, -FLOAT32_MAX, None]
    response = triton_http._infer_response(
        "ensemble", "", {"cum_log_probs": np.array([-np.inf], np.float32)}, {}, default_binary=False
    )
    assert strict_json(response.body)["outputs"][0]["data"] == [-FLOAT32_MAX]
    binary = triton_http._infer_response(
        "ensemble", "", {"cum_log_probs": np.array([-np.inf], np.float32)}, {}, default_binary=True
    )
    head = int(binary.headers["Inference-Header-Content-Length"])
    assert math.isinf(np.frombuffer(binary.body[head:], np.float32)[0])  # binary data stays IEEE


@pytest.mark.parametrize(
    "data, message",
    [
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
        (b"{", "malformed JSON in request body"),
        (b"\xff", "malformed JSON in request body"),
        (b"[1]", "must be a JSON object, got list"),
    ],
)
def test_loads_object_refuses_with_value_error(data, message):
    with pytest.raises(ValueError, match=message):
        loads_object(data)
    assert loads_object(b'{"a": [1]}') == {"a": [1]}
