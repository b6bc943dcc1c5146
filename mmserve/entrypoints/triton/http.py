"""Triton's HTTP API: KServe v2 REST (metadata, config, ready, infer with JSON and binary tensors, repository
index) and the generate extension (`/generate`, `/generate_stream` as SSE). PROTOCOL §2, §3.
Routes reach the shared ServerState through `request.app.state.mm`; their bodies are read by `http_requests.py`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import aclosing
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

import mmserve
from mmserve.entrypoints.json_wire import WireJSONResponse, dumps, loads_object
from mmserve.entrypoints.request_ids import log_client_error
from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton import protocol as tp
from mmserve.entrypoints.triton import run as tr
from mmserve.entrypoints.triton.aux_models import AUX_MODELS, run_aux
from mmserve.entrypoints.triton.http_requests import (
    generate_request,
    parse_infer,
    read_body,
    requested_outputs,
    until_disconnect,
)
from mmserve.entrypoints.triton.models import (
    BLS,
    MODEL_VERSION,
    has_sequence_parameters,
    model_config_json,
    model_metadata,
)
from mmserve.entrypoints.triton.openapi import (
    REPOSITORY_INDEX_REQUEST,
    REPOSITORY_INDEX_RESPONSE,
    generate_request_schema,
    generate_response_schema,
    infer_request_schema,
    infer_response_schema,
    triton_route,
)
from mmserve.entrypoints.triton.outputs import select_outputs
from mmserve.entrypoints.triton.stream_events import (
    SEQUENCE_PARAMETERS,
    StreamEncoder,
    generate_json,
)
from mmserve.entrypoints.triton.tensors import datatype_of, to_json, to_raw

logger = logging.getLogger(__name__)
router = APIRouter()
EXTENSIONS = [
    "model_repository",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "generate",
]


def _state(request: Request) -> ServerState:
    return request.app.state.mm


def _error(exc: BaseException) -> WireJSONResponse:
    status = tp.http_status(exc)
    if status == 500 and not isinstance(exc, ConnectionAbortedError):
        logger.error("request failed: %r", exc, exc_info=exc)
    headers = {"Retry-After": "1"} if status == 503 else None
    message = str(exc) or type(exc).__name__
    if 400 <= status < 500:
        log_client_error(status, message)
    return WireJSONResponse({"error": message}, status_code=status, headers=headers)


def _model_route(suffix: str, method: str, **docs: Any) -> Callable:
    """Register a handler on /v2/models/{model}<suffix> and /v2/models/{model}/versions/{version}<suffix>;
    `docs`: its OpenAPI description (openapi_schemas.py)."""

    def register(fn: Callable) -> Callable:
        for path in (
            f"/v2/models/{{model}}{suffix}",
            f"/v2/models/{{model}}/versions/{{version}}{suffix}",
        ):
            router.add_api_route(path, fn, methods=[method], include_in_schema=True, **docs)
        return fn

    return register


# ---- health, metadata, config, repository ---------------------------------------------------------
@router.get("/v2")
async def server_metadata() -> dict:
    return {"name": "mmserve", "version": mmserve.__version__, "extensions": EXTENSIONS}


@router.get(
    "/v2/models/stats"
)  # before the model routes, which would take "stats" for a model name
async def all_model_statistics(request: Request) -> Response:
    state = _state(request)
    return WireJSONResponse(state.statistics.as_json(state.model_names, MODEL_VERSION))


def _about_model(
    request: Request, model: str, version: str, answer: Callable[[ServerState], Any]
) -> Response:
    """answer(state) as JSON for a known model and version, else the 404."""
    state = _state(request)
    try:
        tp.check_model(state, model, version)
    except Exception as exc:
        return _error(exc)
    return WireJSONResponse(answer(state))


@_model_route("/stats", "GET")
async def model_statistics(request: Request, model: str, version: str = "") -> Response:
    return _about_model(
        request, model, version, lambda state: state.statistics.as_json([model], MODEL_VERSION)
    )


@_model_route("", "GET")
async def get_model_metadata(request: Request, model: str, version: str = "") -> Response:
    return _about_model(request, model, version, lambda state: model_metadata(model))


@_model_route("/ready", "GET")
async def get_model_ready(request: Request, model: str, version: str = "") -> Response:
    state = _state(request)
    ready = state.has_model(model) and version in ("", MODEL_VERSION) and state.ready
    return Response(status_code=200 if ready else 400)


@_model_route("/config", "GET")
async def get_model_config(request: Request, model: str, version: str = "") -> Response:
    return _about_model(
        request,
        model,
        version,
        lambda state: model_config_json(
            model,
            state.config.decoupled,
            state.config.accumulate_tokens,
            state.config.max_batch_size,
        ),
    )


@router.post(
    "/v2/repository/index",
    **triton_route(
        REPOSITORY_INDEX_REQUEST, REPOSITORY_INDEX_RESPONSE, body_required=False, per_model=False
    ),
)
async def repository_index(request: Request) -> Response:
    state = _state(request)
    body = await request.body()
    try:
        ready_only = loads_object(body).get("ready", False) if body.strip() else False
    except ValueError as exc:
        return _error(exc)
    alive = state.engine.dead_error is None
    models = [
        {
            "name": name,
            "version": MODEL_VERSION,
            "state": "READY" if alive else "UNAVAILABLE",
            "reason": "",
        }
        for name in state.model_names
    ]
    return WireJSONResponse([m for m in models if alive or not ready_only])


# ---- KServe infer (JSON + binary tensor extension) ------------------------------------------------


def _infer_response(
    model: str,
    request_id: str,
    outputs: dict[str, np.ndarray],
    binary: dict[str, bool],
    default_binary: bool,
) -> Response:
    doc: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    if request_id:
        doc["id"] = request_id
    if has_sequence_parameters(model):
        doc["parameters"] = dict(SEQUENCE_PARAMETERS)
    entries, blobs = [], []
    for name, arr in outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(arr),
            "shape": list(arr.shape),
        }
        if binary.get(name, default_binary):
            blobs.append(to_raw(arr))
            entry["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            entry["data"] = to_json(arr)
        entries.append(entry)
    doc["outputs"] = entries
    head = dumps(doc)
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(
        head + b"".join(blobs),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )


@_model_route(
    "/infer", "POST", **triton_route(infer_request_schema(), infer_response_schema(), binary=True)
)
async def model_infer(request: Request, model: str, version: str = "") -> Response:
    state = _state(request)
    try:
        tp.check_model(state, model, version)
        body = await read_body(request, state.config.max_request_bytes)
        head, tensors = parse_infer(body, request.headers.get("inference-header-content-length"))
        request_id = head.get("id", "")
        if not isinstance(request_id, str):
            raise ValueError(f"'id' must be a string, got {request_id!r}")
        requested, binary, default_binary = requested_outputs(head)
        if model in AUX_MODELS:  # preprocessing, multimodal_encoders, postprocessing
            outputs = await until_disconnect(request, run_aux(state, model, tensors, requested))
        else:
            reqs = await tp.parse_request(state, model, tensors, request_id)
            outputs = select_outputs(
                await until_disconnect(request, tr.infer(state, reqs)), requested, model
            )
    except Exception as exc:
        return _error(exc)
    return _infer_response(model, request_id, outputs, binary, default_binary)


# ---- generate extension -------------------------------------------------------------------------------


def _generate_json(
    model: str,
    request_id: str,
    tensors: Mapping[str, np.ndarray],
    stream: StreamEncoder | None = None,
) -> bytes:
    """One response as the generate extension writes it (stream_events.generate_json); in a generate_stream,
    `stream` writes the same bytes for a response's standard outputs (`tensors`: all of the response's)."""
    if stream is not None:
        return stream.encode(tensors)
    return generate_json(model, request_id, tensors)


@_model_route(
    "/generate", "POST", **triton_route(generate_request_schema(), generate_response_schema())
)
async def generate(request: Request, model: str, version: str = "") -> Response:
    state = _state(request)
    try:
        _text_model(model)
        request_id, reqs = await generate_request(state, request, model, version)
        tensors = select_outputs(
            await until_disconnect(request, tr.infer(state, reqs)), None, model
        )  # built on this read: a failure to build them answers as one of the request's
    except Exception as exc:
        return _error(exc)
    return Response(_generate_json(model, request_id, tensors), media_type="application/json")


def _text_model(model: str) -> None:
    if model in AUX_MODELS:
        raise ValueError(
            f"'{model}' is served through infer (KServe v2), not the generate extension"
        )


def _sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


@_model_route(
    "/generate_stream",
    "POST",
    **triton_route(generate_request_schema(), generate_response_schema(), sse=True),
)
async def generate_stream(request: Request, model: str, version: str = "") -> Response:
    """SSE: one `data: {...}` event per response; errors before the first response are plain JSON errors,
    later ones `data: {"error": ...}` events (PROTOCOL §2.3). A client that goes away aborts the request."""
    state, responses = _state(request), None
    try:
        _text_model(model)
        request_id, reqs = await generate_request(state, request, model, version)
        if len(reqs) != 1:
            raise ValueError(
                f"text_input: generate_stream takes one prompt (batch size 1), got {len(reqs)}"
            )
        responses = tr.stream(
            state, reqs[0], accumulate=model == BLS and state.config.accumulate_tokens
        )
        first, last = await anext(responses)
        # built here, so that a failure to build the first response's tensors answers before the stream
        first = select_outputs(first, None, model)
        stream = StreamEncoder(model, request_id)
    except Exception as exc:
        if responses is not None:
            await responses.aclose()
        return _error(exc)

    async def events():
        async with aclosing(responses):
            try:
                yield _sse(_generate_json(model, request_id, first, stream))
                if last:
                    return
                async for tensors, _ in responses:
                    yield _sse(_generate_json(model, request_id, tensors, stream))
            except Exception as exc:  # the status (200) is already sent
                if tp.http_status(exc) == 500:
                    logger.error("generate_stream failed mid-stream", exc_info=exc)
                else:
                    logger.info("generate_stream failed mid-stream: %r", exc)
                yield _sse(dumps({"error": str(exc) or type(exc).__name__}))

    return _ClosingStream(events(), responses)


class _ClosingStream(StreamingResponse):
    """SSE response that always closes the engine-side generator, even if the body never started."""

    def __init__(self, content, responses) -> None:
        super().__init__(content, media_type="text/event-stream; charset=utf-8")
        self._responses = responses

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._responses.aclose()
