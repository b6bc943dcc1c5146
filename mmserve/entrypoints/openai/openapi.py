"""/openapi.json for the OpenAI-shaped routes (/v1/chat/completions, /v1/completions, /tokenize, /detokenize): the
pydantic request model's JSON schema (validation mode) as the request body, with its `$defs` inlined (FastAPI puts
only the models it validates or answers with into `components`, so refs to them would not resolve); the response
and error models go through `responses` and so land in `components/schemas`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from mmserve.entrypoints.openai.protocol import ErrorResponse
from mmserve.entrypoints.openapi_schemas import JSON, SSE, JsonSchema, inline_defs, request_body


def openai_route(
    request: type[BaseModel],
    response: type[BaseModel] | JsonSchema,
    *,
    streams: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of an OpenAI-shaped route's decorator: the request body from `request`, the 200 from
    `response` (a model, or a JSON schema), SSE as well when `streams`, and OpenAI's error object."""
    ok: dict[str, Any] = {"description": "the answer"}
    if isinstance(response, dict):
        ok["content"] = {JSON: {"schema": response}}
    else:
        ok["model"] = response
    if streams:
        ok["description"] = (
            'the answer; with `"stream": true`, server-sent events `data: {chunk}` ending in '
            "`data: [DONE]`"
        )
        ok.setdefault("content", {})[SSE] = {"schema": {"type": "string"}}
    error = {"model": ErrorResponse}
    return {
        "openapi_extra": {
            "requestBody": request_body(inline_defs(request.model_json_schema(mode="validation")))
        },
        "responses": {
            200: ok,
            400: {**error, "description": "an invalid request; `error.param` names the parameter"},
            404: {
                **error,
                "description": "the model is not served (`error.code`: `model_not_found`)",
            },
            "default": {
                **error,
                "description": "any other error (403 restricted API, 413 body too large, "
                "503 server busy, 500)",
            },
        },
    }


TOKENIZE_RESPONSE: JsonSchema = {
    "type": "object",
    "required": ["tokens", "count", "max_model_len"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
    },
}

DETOKENIZE_RESPONSE: JsonSchema = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}
