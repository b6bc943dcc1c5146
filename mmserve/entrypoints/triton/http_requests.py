"""Reading the bodies of Triton's HTTP requests: Content-Encoding, KServe v2 infer's JSON header and binary tensor
data, the outputs it asks for, and the generate extension's JSON; each into input tensors for `protocol.py`. Also
`until_disconnect`: a request's work, cancelled when its client goes away."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable
from typing import Any

import numpy as np
from fastapi import Request

from mmserve.entrypoints.json_wire import loads_object
from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton import protocol as tp
from mmserve.entrypoints.triton.models import ACCEPTED_INPUTS, inputs_of
from mmserve.entrypoints.triton.requests import TritonRequest
from mmserve.entrypoints.triton.tensors import (
    check_datatype,
    check_shape,
    from_generate_value,
    from_json,
    from_raw,
)


async def read_body(request: Request, limit: int) -> bytes:
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


async def until_disconnect(request: Request, work: Awaitable) -> Any:
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


def parse_infer(body: bytes, header_length: str | None) -> tuple[dict, dict[str, np.ndarray]]:
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


def requested_outputs(head: dict) -> tuple[list[str] | None, dict[str, bool], bool]:
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


async def generate_request(
    state: ServerState, request: Request, model: str, version: str
) -> tuple[str, list[TritonRequest]]:
    """JSON body -> (request id, one request per batch item). Keys naming inputs become tensors; others are
    request parameters, ignored as by Triton's LLM models."""
    tp.check_model(state, model, version)
    doc = loads_object(await read_body(request, state.config.max_request_bytes))
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
