"""Triton's HTTP API: KServe v2 REST (metadata, config, ready, infer with JSON and binary tensors, repository
index) and the generate extension (`/generate`, `/generate_stream` as SSE). PROTOCOL §2, §3.
Routes reach the shared ServerState through `request.app.state.mm`."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

import mmserve
from mmserve.entrypoints import triton_protocol as tp
from mmserve.entrypoints import triton_run as tr
from mmserve.entrypoints.json_wire import WireJSONResponse, dumps, loads_object
from mmserve.entrypoints.openapi_schemas import (
    REPOSITORY_INDEX_REQUEST,
    REPOSITORY_INDEX_RESPONSE,
    generate_request_schema,
    generate_response_schema,
    infer_request_schema,
    infer_response_schema,
    triton_route,
)
from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton_models import (
    ACCEPTED_INPUTS,
    BLS,
    MODEL_VERSION,
    has_sequence_parameters,
    inputs_of,
    model_config_json,
    model_metadata,
)
from mmserve.entrypoints.triton_outputs import select_outputs
from mmserve.entrypoints.triton_tensors import (
    check_datatype,
    check_shape,
    datatype_of,
    from_generate_value,
    from_json,
    from_raw,
    to_json,
    to_raw,
)

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
SEQUENCE_PARAMETERS = {"sequence_id": 0, "sequence_start": False, "sequence_end": False}


def _state(request: Request) -> ServerState:
    return request.app.state.mm


def _error(exc: BaseException) -> WireJSONResponse:
    status = tp.http_status(exc)
    if status == 500 and not isinstance(exc, ConnectionAbortedError):
        logger.error("request failed: %r", exc, exc_info=exc)
    headers = {"Retry-After": "1"} if status == 503 else None
    return WireJSONResponse(
        {"error": str(exc) or type(exc).__name__}, status_code=status, headers=headers
    )


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


async def _body(request: Request, limit: int) -> bytes:
    """The request body, decompressed when Content-Encoding says gzip or deflate (at most `limit` bytes)."""
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise ValueError(
            f"Unsupported content-encoding '{encoding}', only identity, gzip and deflate are supported"
        )
    inflater = zlib.decompressobj(wbits=47)  # 32 + 15: gzip or zlib header, detected
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ValueError(f"request body is not valid {encoding} data: {exc}") from exc
    if len(data) > limit:
        raise ValueError(f"decompressed request body exceeds the limit of {limit} bytes")
    return data


async def _until_disconnect(request: Request, work: Awaitable) -> Any:
    """Await `work` (the body must have been read), cancelling it if the client goes away first, so
    that the engine aborts the request and frees its KV blocks."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ConnectionAbortedError("client disconnected")
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


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
    ready = (
        state.has_model(model)
        and version in ("", MODEL_VERSION)
        and state.engine.dead_error is None
    )
    return Response(status_code=200 if ready else 400)


@_model_route("/config", "GET")
async def get_model_config(request: Request, model: str, version: str = "") -> Response:
    return _about_model(
        request,
        model,
        version,
        lambda state: model_config_json(
            model, state.config.decoupled, state.config.accumulate_tokens
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
def _parse_infer(body: bytes, header_length: str | None) -> tuple[dict, dict[str, np.ndarray]]:
    """Infer request body -> (the JSON header, input tensors)."""
    if header_length is not None:
        if not header_length.strip().isdigit() or int(header_length) > len(body):
            raise ValueError(
                f"Inference-Header-Content-Length {header_length!r} is not a length within the body"
            )
        if int(header_length) == 0:
            raise ValueError(
                "raw binary requests (Inference-Header-Content-Length: 0) need a single-input model"
            )
        cut = int(header_length)
        head, binary = loads_object(memoryview(body)[:cut]), memoryview(body)[cut:]
    else:
        head, binary = loads_object(body), memoryview(b"")
    inputs = head.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("'inputs' must be a non-empty list of tensors")
    tensors, pos = {}, 0
    for i, spec in enumerate(inputs):
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError(f"inputs[{i}] must be an object with a string 'name'")
        name = spec["name"]
        if name in tensors:
            raise ValueError(f"{name}: input given more than once")
        datatype = check_datatype(name, spec.get("datatype"))
        shape = check_shape(name, spec.get("shape"))
        params = spec.get("parameters") or {}
        if not isinstance(params, dict):
            raise ValueError(f"{name}: 'parameters' must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if (
                isinstance(size, bool)
                or not isinstance(size, int)
                or size < 0
                or pos + size > len(binary)
            ):
                raise ValueError(
                    f"{name}: binary_data_size {size!r} does not fit the {len(binary) - pos} "
                    "binary bytes left after the JSON header"
                )
            tensors[name] = from_raw(name, datatype, shape, binary[pos : pos + size])
            pos += size
        elif "data" in spec:
            tensors[name] = from_json(name, datatype, shape, spec["data"])
        else:
            raise ValueError(
                f"{name}: the input has neither 'data' nor a binary_data_size parameter"
            )
    if pos != len(binary):
        raise ValueError(
            f"{len(binary) - pos} bytes of binary data after the JSON header belong to no input"
        )
    return head, tensors


def _requested_outputs(head: dict) -> tuple[list[str] | None, dict[str, bool], bool]:
    """(requested output names or None, per-output binary_data flags, request-level binary_data_output)."""
    params = head.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValueError("'parameters' must be an object")
    default_binary = bool(params.get("binary_data_output", False))
    outputs = head.get("outputs")
    if outputs is None:
        return None, {}, default_binary
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise ValueError("'outputs' must be a list of objects with a string 'name'")
    flags = {
        o["name"]: bool((o.get("parameters") or {}).get("binary_data", default_binary))
        for o in outputs
    }
    return [o["name"] for o in outputs], flags, default_binary


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
        body = await _body(request, state.config.max_request_bytes)
        head, tensors = _parse_infer(body, request.headers.get("inference-header-content-length"))
        request_id = head.get("id", "")
        if not isinstance(request_id, str):
            raise ValueError(f"'id' must be a string, got {request_id!r}")
        requested, binary, default_binary = _requested_outputs(head)
        reqs = await tp.parse_request(state, model, tensors, request_id)
        outputs = select_outputs(
            await _until_disconnect(request, tr.infer(state, reqs)), requested, model
        )
    except Exception as exc:
        return _error(exc)
    return _infer_response(model, request_id, outputs, binary, default_binary)


# ---- generate extension -------------------------------------------------------------------------------
async def _generate_request(
    request: Request, model: str, version: str
) -> tuple[str, list[tp.TritonRequest]]:
    """JSON body -> (request id, one request per batch item). Keys naming inputs become tensors; others are
    request parameters, ignored as by Triton's LLM models."""
    state = _state(request)
    tp.check_model(state, model, version)
    doc = loads_object(await _body(request, state.config.max_request_bytes))
    request_id = doc.pop("id", "")
    if not isinstance(request_id, str):
        raise ValueError(f"'id' must be a string, got {request_id!r}")
    nested = doc.pop("parameters", {})
    if not isinstance(nested, dict):
        raise ValueError("'parameters' must be a JSON object")
    specs = {s.name: s for s in inputs_of(model)}
    tensors = {}
    for key, value in [*doc.items(), *nested.items()]:
        spec = specs.get(key) or ACCEPTED_INPUTS.get(key)
        if spec is not None:
            tensors[key] = from_generate_value(key, spec.datatype, spec.dims, value)
    return request_id, await tp.parse_request(state, model, tensors, request_id)


def _generate_json(model: str, request_id: str, tensors: dict[str, np.ndarray]) -> bytes:
    """One response as the generate extension writes it: outputs flattened (a bare scalar when one element),
    parameters as keys, all keys sorted."""
    doc: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    if request_id:
        doc["id"] = request_id
    if has_sequence_parameters(model):
        doc.update(SEQUENCE_PARAMETERS)
    for name, arr in tensors.items():
        values = to_json(arr)
        doc[name] = values[0] if len(values) == 1 else values
    return dumps(doc, sort_keys=True)


@_model_route(
    "/generate", "POST", **triton_route(generate_request_schema(), generate_response_schema())
)
async def generate(request: Request, model: str, version: str = "") -> Response:
    state = _state(request)
    try:
        request_id, reqs = await _generate_request(request, model, version)
        tensors = await _until_disconnect(request, tr.infer(state, reqs))
    except Exception as exc:
        return _error(exc)
    return Response(
        _generate_json(model, request_id, select_outputs(tensors, None, model)),
        media_type="application/json",
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
    state = _state(request)
    try:
        request_id, reqs = await _generate_request(request, model, version)
        if len(reqs) != 1:
            raise ValueError(
                f"text_input: generate_stream takes one prompt (batch size 1), got {len(reqs)}"
            )
        responses = tr.stream(
            state, reqs[0], accumulate=model == BLS and state.config.accumulate_tokens
        )
        first, last = await anext(responses)
    except Exception as exc:
        return _error(exc)

    async def events():
        async with aclosing(responses):
            try:
                yield _sse(_generate_json(model, request_id, select_outputs(first, None, model)))
                if last:
                    return
                async for tensors, _ in responses:
                    yield _sse(
                        _generate_json(model, request_id, select_outputs(tensors, None, model))
                    )
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
