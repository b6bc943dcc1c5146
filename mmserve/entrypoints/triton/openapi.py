"""/openapi.json for Triton's routes: hand-written JSON schemas of the generate extension's and KServe v2 infer's
bodies from the tensor specs of `models.py` (every text model's `ACCEPTED_INPUTS` and the token-level model's
`TRTLLM_INPUTS`), and Triton's `{"error": message}` error shape."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi.responses import StreamingResponse

from mmserve.entrypoints.openapi_schemas import JSON, SSE, JsonSchema, request_body
from mmserve.entrypoints.triton.models import (
    ACCEPTED_INPUTS,
    BLS_EXTRA_OUTPUTS,
    OUTPUTS,
    TRTLLM_INPUTS,
    TRTLLM_OUTPUTS,
    TensorSpec,
)
from mmserve.entrypoints.triton.tensors import NP_DTYPES


def element_schema(datatype: str) -> JsonSchema:
    """One JSON element of a tensor of a Triton datatype (strings for BYTES, booleans for BOOL, integers within
    the type's range, numbers)."""
    if datatype == "BYTES":
        return {"type": "string"}
    if datatype == "BOOL":
        return {"type": "boolean"}
    if datatype.startswith(("INT", "UINT")):
        info = np.iinfo(NP_DTYPES[datatype])
        return {"type": "integer", "minimum": int(info.min), "maximum": int(info.max)}
    return {"type": "number"}


def _generate_value(spec: TensorSpec) -> JsonSchema:
    """A generate-extension value: a scalar, or a flat array of the tensor's elements (a batch, or an input with
    several values per item)."""
    element = element_schema(spec.datatype)
    dims = ", ".join(map(str, spec.dims))
    return {
        "description": f"{spec.datatype} [-1, {dims}]: a scalar or a flat array",
        "anyOf": [element, {"type": "array", "items": element}],
    }


def _generate_inputs() -> dict[str, JsonSchema]:
    """Every input name a generate body may carry: the text models' (with the old aliases) and the token-level
    `tensorrt_llm` model's."""
    specs = {**ACCEPTED_INPUTS, **{s.name: s for s in TRTLLM_INPUTS}}
    return {name: _generate_value(spec) for name, spec in sorted(specs.items())}


def generate_request_schema() -> JsonSchema:
    """The JSON body of `/v2/models/{model}/generate` and `generate_stream`."""
    inputs = _generate_inputs()
    return {
        "type": "object",
        "description": "Keys naming inputs (top level or in `parameters`) become tensors; other keys are ignored. "
        "The text models need `text_input` (and `max_tokens` for `ensemble` / `tensorrt_llm_bls`), "
        "the token-level `tensorrt_llm` model `input_ids`, `input_lengths` and `request_output_len`.",
        "properties": {
            "id": {"type": "string", "description": "the request id, repeated in the response"},
            "parameters": {
                "type": "object",
                "properties": inputs,
                "additionalProperties": True,
                "description": "more inputs (as at the top level) and ignored request parameters",
            },
            **inputs,
        },
        "additionalProperties": True,
    }


def generate_response_schema() -> JsonSchema:
    """One generate-extension response (also each `generate_stream` event's data): outputs flattened, a bare
    scalar when one element."""
    outputs = {s.name: _generate_value(s) for s in (*OUTPUTS, *TRTLLM_OUTPUTS, *BLS_EXTRA_OUTPUTS)}
    return {
        "type": "object",
        "required": ["model_name", "model_version"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "sequence_id": {"type": "integer"},
            "sequence_start": {"type": "boolean"},
            "sequence_end": {"type": "boolean"},
            **dict(sorted(outputs.items())),
        },
        "additionalProperties": True,
    }


def _tensor_parameters(flag: str, flag_schema: JsonSchema) -> JsonSchema:
    return {"type": "object", "properties": {flag: flag_schema}, "additionalProperties": True}


def infer_request_schema() -> JsonSchema:
    """The JSON body (or JSON header, with `Inference-Header-Content-Length`) of KServe v2 `/infer`."""
    names = sorted({*ACCEPTED_INPUTS, *(s.name for s in TRTLLM_INPUTS)})
    tensor = {
        "type": "object",
        "required": ["name", "datatype", "shape"],
        "properties": {
            "name": {
                "type": "string",
                "enum": names,
                "description": "an input of the model (`GET /v2/models/{model}` lists its own)",
            },
            "datatype": {"type": "string", "enum": list(NP_DTYPES)},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "data": {
                "description": "the elements in row-major order, flat or nested (strings for BYTES)"
            },
            "parameters": _tensor_parameters("binary_data_size", {"type": "integer", "minimum": 0}),
        },
    }
    output = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string"},
            "parameters": _tensor_parameters("binary_data", {"type": "boolean"}),
        },
    }
    return {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": _tensor_parameters("binary_data_output", {"type": "boolean"}),
            "inputs": {"type": "array", "minItems": 1, "items": tensor},
            "outputs": {"type": "array", "items": output},
        },
    }


def infer_response_schema() -> JsonSchema:
    tensor = {
        "type": "object",
        "required": ["name", "datatype", "shape"],
        "properties": {
            "name": {"type": "string"},
            "datatype": {"type": "string", "enum": list(NP_DTYPES)},
            "shape": {"type": "array", "items": {"type": "integer"}},
            "data": {"type": "array"},
            "parameters": _tensor_parameters("binary_data_size", {"type": "integer"}),
        },
    }
    return {
        "type": "object",
        "required": ["model_name", "model_version", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "outputs": {"type": "array", "items": tensor},
        },
    }


TRITON_ERROR: JsonSchema = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string"}},
}


def _triton_errors(per_model: bool) -> dict[int | str, Any]:
    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": {JSON: {"schema": TRITON_ERROR}}}

    errors: dict[int | str, Any] = {
        400: error("bad input; the message starts with the input it is about")
    }
    if per_model:
        errors[404] = error("unknown model or version")
        errors[503] = error("server busy (`Retry-After: 1`) or the engine has stopped")
    errors["default"] = error("any other error (403 restricted API, 413 body too large, 500)")
    return errors


def triton_route(
    request: JsonSchema,
    response: JsonSchema,
    *,
    sse: bool = False,
    binary: bool = False,
    body_required: bool = True,
    per_model: bool = True,
) -> dict[str, Any]:
    """Keyword arguments of a Triton route's registration: the JSON request body, the 200 (`response`; as
    server-sent events whose `data` are such objects when `sse`; also the binary tensor extension's octet stream
    when `binary`) and Triton's `{"error": message}` errors (404 and 503 too when `per_model`)."""
    if sse:
        content: dict[str, Any] = {SSE: {"schema": {"type": "string"}}}
        description = (
            "server-sent events `data: {response}`, each response as in `/generate` (or "
            '`data: {"error": message}` after the first)'
        )
    else:
        content, description = {JSON: {"schema": response}}, "the response"
    if binary:
        content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
        description += (
            "; with binary outputs, `application/octet-stream`: the JSON header (its length in "
            "`Inference-Header-Content-Length`), then the outputs' bytes"
        )
    docs = {
        "openapi_extra": {"requestBody": request_body(request, body_required)},
        "responses": {
            200: {"description": description, "content": content},
            **_triton_errors(per_model),
        },
    }
    if sse:  # not the default JSON 200 (the handlers return their responses themselves, so this is docs only)
        docs["response_class"] = StreamingResponse
    return docs


REPOSITORY_INDEX_REQUEST: JsonSchema = {
    "type": "object",
    "properties": {"ready": {"type": "boolean", "description": "only the models ready"}},
}

REPOSITORY_INDEX_RESPONSE: JsonSchema = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["name", "version", "state", "reason"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "state": {"type": "string", "enum": ["READY", "UNAVAILABLE"]},
            "reason": {"type": "string"},
        },
    },
}
