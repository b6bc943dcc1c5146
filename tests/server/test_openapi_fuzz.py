"""/openapi.json of a real `mmserve serve` (tiny LLaVA, CPU, 127.0.0.1): the POST routes publish their request
bodies, and a bounded schemathesis pass over those routes (positive and negative cases from the published
schemas) gets no 5xx answer and leaves the server healthy.

The pass is bounded three ways: a fixed number of cases per operation (a few hundred in all), a wall-clock budget
after which the remaining cases are generated but not sent, and per-request timeouts. Generated values that
would make the tiny model generate for long (`max_tokens`, `n`, beams, ...) are cut to small ones before a
case is sent; everything else goes out as generated. `MMSERVE_FUZZ_SEED` picks another set of cases.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from openapi_spec_validator import validate as validate_openapi
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok

from mmserve.entrypoints.triton.models import ACCEPTED_INPUTS, TRTLLM_INPUTS
from tests.server.conftest import start_server

FUZZ_BUDGET_S = (
    60.0  # after this, remaining cases are not sent (the test stays well under 2 minutes)
)
REQUEST_TIMEOUT_S = 30.0
SMALL_TOKENS = 3  # max_tokens and friends above this are cut to it
SMALL_COUNT = 2  # n, best_of, beam widths, sequences above this are cut to it
# cases per operation (positive, negative); the versioned twins of the model routes run the same handlers
CASES = {"primary": (40, 15), "versioned": (6, 3)}
SCALE = float(
    os.environ.get("MMSERVE_FUZZ_SCALE", "1")
)  # more cases (and budget) for a longer local run

# Triton inputs that a "focused" case keeps (the others, pictures, LoRA tensors and prompt tables, make nearly every
# generated body a 400 before it reaches sampling)
FOCUS_INPUTS = {
    "text_input",
    "decoder_text_input",
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "length_penalty",
    "stop_words",
    "bad_words",
    "end_id",
    "pad_id",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "beam_width",
    "num_return_sequences",
    "exclude_input_in_output",
    "stream",
    "embedding_bias_words",
    "embedding_bias_weights",
    "guided_decoding_guide_type",
    "guided_decoding_guide",
    "input_ids",
    "input_lengths",
    "request_output_len",
    "runtime_top_k",
    "runtime_top_p",
    "len_penalty",
    "streaming",
    "stop",
    "id",
    "parameters",
}
TOKEN_KEYS = {
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "min_length",
    "request_output_len",
}
COUNT_KEYS = {
    "n",
    "best_of",
    "beam_width",
    "num_return_sequences",
    "prompt_logprobs",
    "top_logprobs",
    "logprobs",
}

_DATATYPES = {
    name: spec.datatype
    for name, spec in (*ACCEPTED_INPUTS.items(), *((s.name, s) for s in TRTLLM_INPUTS))
}

POST_ROUTES = {
    "/v1/chat/completions": {"model", "messages", "max_tokens", "temperature", "stream", "n"},
    "/v1/completions": {"model", "prompt", "max_tokens", "echo", "logprobs"},
    "/tokenize": {"model", "prompt", "messages", "add_special_tokens"},
    "/detokenize": {"model", "tokens"},
    "/v2/models/{model}/generate": {
        "id",
        "parameters",
        "text_input",
        "max_tokens",
        "image_url_input",
        "image_input",
        "image_bytes_input",
        "input_ids",
        "request_output_len",
    },
    "/v2/models/{model}/generate_stream": {
        "id",
        "parameters",
        "text_input",
        "max_tokens",
        "image_url_input",
        "stream",
    },
    "/v2/models/{model}/versions/{version}/generate": {"text_input", "max_tokens"},
    "/v2/models/{model}/versions/{version}/generate_stream": {"text_input", "max_tokens"},
    "/v2/models/{model}/infer": {"id", "inputs", "outputs", "parameters"},
    "/v2/models/{model}/versions/{version}/infer": {"inputs"},
    "/v2/repository/index": {"ready"},
}


@pytest.fixture(scope="module")
def fuzz_server(tiny_llava_dir, tmp_path_factory):
    """A server of its own: the pass may load LoRA adapters and fill caches that other modules should not see."""
    with start_server(
        tiny_llava_dir, tmp_path_factory.mktemp("fuzz-logs"), "--media-fetch-timeout", "2"
    ) as handle:
        yield handle


@pytest.fixture(scope="module")
def openapi(fuzz_server) -> dict[str, Any]:
    r = httpx.get(f"{fuzz_server.http_url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


# ---- the published schemas ------------------------------------------------------------------------------------


def _refs(node: Any):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        schema = node
    return schema


def test_post_routes_publish_request_and_error_schemas(openapi):
    assert openapi["openapi"].startswith("3.1")
    for path, keys in POST_ROUTES.items():
        op = openapi["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object", path
        assert keys <= set(schema["properties"]), (path, keys - set(schema["properties"]))
        assert "200" in op["responses"] and "400" in op["responses"], path
        assert "422" not in op["responses"], path  # FastAPI's default; these routes answer 400
        error = _resolve(openapi, op["responses"]["400"]["content"]["application/json"]["schema"])
        assert error["required"] == ["error"], path
    # the request models' parts are inlined, the response models are components: every ref resolves
    for ref in _refs(openapi):
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in openapi["components"]["schemas"], ref
    chat = openapi["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["required"] == [
        "model",
        "messages",
    ]
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert _resolve(openapi, chat["responses"]["400"]["content"]["application/json"]["schema"])[
        "properties"
    ]["error"]["$ref"].endswith("/ErrorInfo")
    generate = openapi["paths"]["/v2/models/{model}/generate"]["post"]["requestBody"]["content"]
    text_input = generate["application/json"]["schema"]["properties"]["text_input"]
    assert {"type": "string"} in text_input["anyOf"] and {
        "type": "array",
        "items": {"type": "string"},
    } in text_input["anyOf"]  # a scalar, or a list for a batch
    infer = openapi["paths"]["/v2/models/{model}/infer"]["post"]["requestBody"]["content"][
        "application/json"
    ]
    assert infer["schema"]["properties"]["inputs"]["items"]["required"] == [
        "name",
        "datatype",
        "shape",
    ]


def test_openapi_document_is_valid_openapi_3_1(openapi):
    validate_openapi(openapi)


# ---- the fuzz pass --------------------------------------------------------------------------------------------


def _small(value: Any, limit: int) -> Any:
    """Numbers (also inside lists) above `limit` cut to it; anything else unchanged (bad values stay bad)."""
    if isinstance(value, list):
        return [_small(v, limit) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
        return limit
    return value


def _tame_object(doc: dict[str, Any]) -> None:
    for key in list(doc):
        if key in TOKEN_KEYS:
            doc[key] = _small(doc[key], SMALL_TOKENS)
        elif key in COUNT_KEYS:
            doc[key] = _small(doc[key], SMALL_COUNT)
    if isinstance(doc.get("parameters"), dict):
        _tame_object(doc["parameters"])
    inputs = doc.get("inputs")
    for tensor in (
        inputs if isinstance(inputs, list) else []
    ):  # KServe infer: the same inputs as tensors
        if isinstance(tensor, dict) and "data" in tensor:
            name = tensor.get("name")
            if name in TOKEN_KEYS or name in COUNT_KEYS:
                tensor["data"] = _small(
                    tensor["data"], SMALL_TOKENS if name in TOKEN_KEYS else SMALL_COUNT
                )


def _focus(body: dict[str, Any], path: str) -> None:
    """Keep the inputs of FOCUS_INPUTS; give a prompt when there is none; KServe tensors get their input's datatype
    and a shape that fits their data."""
    for doc in (body, body.get("parameters")):
        if isinstance(doc, dict):
            for key in [k for k in doc if k not in FOCUS_INPUTS]:
                del doc[key]
    if path.endswith(("/generate", "/generate_stream")):
        body.setdefault("text_input", "hi")
        body.setdefault("max_tokens", SMALL_TOKENS)
        return
    tensors = body.get("inputs") if isinstance(body.get("inputs"), list) else []
    inputs = [t for t in tensors if isinstance(t, dict) and t.get("name") in FOCUS_INPUTS]
    for tensor in inputs:
        data = tensor.get("data")
        data = data if isinstance(data, list) else [data]
        tensor.update(datatype=_DATATYPES[tensor["name"]], data=data, shape=[1, len(data)])
        tensor.pop("parameters", None)
    if not any(t["name"] == "text_input" for t in inputs):
        inputs.append({"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["hi"]})
    if not any(t["name"] == "max_tokens" for t in inputs):
        inputs.append(
            {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [SMALL_TOKENS]}
        )
    body["inputs"] = inputs


def _tame(case, model: str | None, version: str | None, path: str, focus: bool) -> None:
    """Point a share of the cases at served models, focus a share of the Triton ones (FOCUS_INPUTS), and keep
    generation short."""
    if model is not None and "model" in (case.path_parameters or {}):
        case.path_parameters["model"] = model
    if version is not None and "version" in (case.path_parameters or {}):
        case.path_parameters["version"] = version
    elif version is not None and "version" in (
        case.query or {}
    ):  # the unversioned routes take ?version=
        case.query["version"] = version
    body = case.body
    if not isinstance(body, dict):
        return
    if (
        model is not None
        and path.startswith(("/v1/", "/tokenize", "/detokenize"))
        and "model" in body
    ):
        body["model"] = model
    if focus and path.startswith("/v2/models/"):
        _focus(body, path)
    _tame_object(body)
    if path.startswith("/v1/") and not any(
        isinstance(body.get(k), (int, float)) and not isinstance(body.get(k), bool)
        for k in ("max_tokens", "max_completion_tokens")
    ):
        body["max_tokens"] = SMALL_TOKENS  # chat's default is the rest of the context


@dataclass
class _Pass:
    deadline: float
    sent: int = 0
    skipped: int = 0
    statuses: dict[str, dict[int, int]] = field(default_factory=dict)  # per operation
    failures: list[str] = field(default_factory=list)


def _run_operation(
    operation, served: list[str], mode, examples: int, state: _Pass, base_url: str
) -> None:
    path = operation.path
    names_model = "{model}" in path or not path.startswith(
        "/v2/"
    )  # in the path, or the OpenAI body's `model`
    models = st.sampled_from([*served, None]) if names_model else st.just(None)
    versions = (
        st.sampled_from(["1", "1", None]) if path.startswith("/v2/models/") else st.just(None)
    )

    @seed(int(os.environ.get("MMSERVE_FUZZ_SEED", "0")))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(
        case=operation.as_strategy(generation_mode=mode),
        model=models,
        version=versions,
        focus=st.booleans(),
    )
    def one(case, model, version, focus) -> None:
        if time.monotonic() > state.deadline:
            state.skipped += 1
            return
        _tame(case, model, version, path, focus)
        try:
            response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # a timeout or a dropped connection is a failure too
            state.failures.append(
                f"{operation.label}: {type(exc).__name__}: {exc}\n  body: {_short(case.body)}"
            )
            return
        state.sent += 1
        counts = state.statuses.setdefault(operation.label, {})
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=[not_a_server_error])
        except FailureGroup:
            state.failures.append(
                f"{operation.label} -> {response.status_code} {response.text[:300]!r}\n"
                f"  {case.as_curl_command(base_url=base_url)}"
            )

    one()


def _short(body: Any) -> str:
    text = json.dumps(body, default=str)
    return text if len(text) < 600 else text[:600] + "..."


def test_schemathesis_pass_over_post_routes_gets_no_server_error(fuzz_server):
    base_url = fuzz_server.http_url
    served = [m["id"] for m in httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]]
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
    operations = [r.ok() for r in schema.get_all_operations() if isinstance(r, Ok)]
    operations = [op for op in operations if op.method.upper() == "POST"]
    assert {op.path for op in operations} == set(POST_ROUTES)

    start = time.monotonic()
    state = _Pass(deadline=start + FUZZ_BUDGET_S * SCALE)
    for operation in operations:
        positive, negative = (
            round(n * SCALE)
            for n in CASES["versioned" if "{version}" in operation.path else "primary"]
        )
        for mode, examples in (
            (schemathesis.GenerationMode.POSITIVE, positive),
            (schemathesis.GenerationMode.NEGATIVE, negative),
        ):
            _run_operation(operation, served, mode, examples, state, base_url)
    elapsed = time.monotonic() - start
    print(
        f"\nschemathesis: {state.sent} cases sent in {elapsed:.1f}s ({state.skipped} over the budget, not sent)"
    )
    for label, counts in state.statuses.items():
        print(f"  {label}: {dict(sorted(counts.items()))}")

    health = httpx.get(f"{base_url}/v2/health/ready", timeout=30)
    assert (
        health.status_code == 200 and httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    )
    assert state.sent >= 100, f"only {state.sent} cases sent within {FUZZ_BUDGET_S}s"
    if state.failures:
        log = fuzz_server.log()
        tracebacks = log[log.find("Traceback") :][-6000:] if "Traceback" in log else log[-3000:]
        pytest.fail(
            f"{len(state.failures)} server errors:\n"
            + "\n".join(state.failures[:20])
            + f"\n--- server log ---\n{tracebacks}"
        )
