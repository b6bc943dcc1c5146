"""KServe v2 gRPC (`inference.GRPCInferenceService`, PROTOCOL §4) on grpc.aio, with tritonclient's generated
stubs. ModelInfer returns one response; ModelStreamInfer is decoupled: several requests may be in flight
on one stream, each answered by a response per new text piece and a final-flagged one. Its interceptors are
`grpc_interceptors.py`'s."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

import mmserve
from mmserve.entrypoints import request_ids as ids
from mmserve.entrypoints.request_phases import bytes_out, start_timed_call, timed_call
from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton import protocol as tp
from mmserve.entrypoints.triton import run as tr
from mmserve.entrypoints.triton.aux_models import AUX_MODELS, run_aux
from mmserve.entrypoints.triton.grpc_interceptors import RestrictedProtocols, UnexpectedErrors
from mmserve.entrypoints.triton.models import (
    BLS,
    MODEL_VERSION,
    has_sequence_parameters,
    model_config,
    model_metadata,
)
from mmserve.entrypoints.triton.outputs import select_outputs
from mmserve.entrypoints.triton.tensors import (
    NP_DTYPES,
    check_datatype,
    check_shape,
    datatype_of,
    from_raw,
    to_raw,
)

logger = logging.getLogger(__name__)
EXTENSIONS = [
    "model_repository",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
]
_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    503: grpc.StatusCode.UNAVAILABLE,
    500: grpc.StatusCode.INTERNAL,
}
# typed `contents` field of each datatype (FP16 has none: it must come as raw bytes)
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_DONE = object()


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """Input tensors from raw_input_contents (what tritonclient sends) or the typed contents fields."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ValueError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs"
        )
    tensors: dict[str, np.ndarray] = {}
    for i, inp in enumerate(request.inputs):
        name = inp.name
        if name in tensors:
            raise ValueError(f"{name}: input given more than once")
        datatype, shape = check_datatype(name, inp.datatype), check_shape(name, list(inp.shape))
        if raw:
            tensors[name] = from_raw(name, datatype, shape, raw[i])
            continue
        if datatype not in _CONTENTS:
            raise ValueError(f"{name}: {datatype} data must be sent in raw_input_contents")
        values = list(getattr(inp.contents, _CONTENTS[datatype]))
        count = int(np.prod(shape, dtype=np.int64))
        if len(values) != count:
            raise ValueError(f"{name}: shape {shape} needs {count} elements, got {len(values)}")
        arr = np.empty(count, dtype=np.object_) if datatype == "BYTES" else None
        if arr is not None:
            arr[:] = values
        tensors[name] = (
            arr if arr is not None else np.array(values, dtype=NP_DTYPES[datatype])
        ).reshape(shape)
    return tensors


def _response(
    model: str, request_id: str, outputs: dict[str, np.ndarray], final: bool | None = None
) -> pb.ModelInferResponse:
    resp = pb.ModelInferResponse(model_name=model, model_version=MODEL_VERSION, id=request_id)
    for name, arr in outputs.items():
        resp.outputs.add(name=name, datatype=datatype_of(arr), shape=list(arr.shape))
        resp.raw_output_contents.append(to_raw(arr))
    if has_sequence_parameters(model):
        resp.parameters["sequence_id"].int64_param = 0
        resp.parameters["sequence_start"].bool_param = False
        resp.parameters["sequence_end"].bool_param = False
    if final is not None:
        resp.parameters["triton_final_response"].bool_param = final
    return resp


async def _send_request_id(context: grpc.aio.ServicerContext, request_id: str) -> None:
    """The call's request id back to the client, as HTTP's X-Request-Id header: in the initial metadata."""
    await context.send_initial_metadata(((ids.HEADER.decode(), request_id),))


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    code = tp.http_status(exc)
    if code == 500:
        logger.error("gRPC request failed: %r", exc, exc_info=exc)
    return _STATUS.get(code, grpc.StatusCode.INTERNAL), str(exc) or type(exc).__name__


class TritonServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ---- health and metadata ---------------------------------------------------------------------------
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelReadyResponse:
        s = self.state
        ready = s.has_model(request.name) and request.version in ("", MODEL_VERSION) and s.ready
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name="mmserve", version=mmserve.__version__, extensions=EXTENSIONS
        )

    async def _check(self, name: str, version: str, context: grpc.aio.ServicerContext) -> bool:
        try:
            tp.check_model(self.state, name, version)
            return True
        except tp.ModelNotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            return False

    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        await self._check(request.name, request.version, context)
        meta = model_metadata(request.name)
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["outputs"]],
        )

    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        await self._check(request.name, request.version, context)
        cfg = self.state.config
        return pb.ModelConfigResponse(
            config=model_config(
                request.name, cfg.decoupled, cfg.accumulate_tokens, cfg.max_batch_size
            )
        )

    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        alive = self.state.engine.dead_error is None
        models = [
            pb.RepositoryIndexResponse.ModelIndex(
                name=name, version=MODEL_VERSION, state="READY" if alive else "UNAVAILABLE"
            )
            for name in self.state.model_names
        ]
        return pb.RepositoryIndexResponse(models=[m for m in models if alive or not request.ready])

    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelStatisticsResponse:
        state = self.state
        if request.name:
            try:
                tp.check_model(state, request.name, request.version)
            except Exception as exc:
                await context.abort(*_status(exc))
        names = [request.name] if request.name else state.model_names
        return json_format.ParseDict(
            state.statistics.as_json(names, MODEL_VERSION), pb.ModelStatisticsResponse()
        )

    # ---- inference ---------------------------------------------------------------------------------------
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        state, error = self.state, None
        caller = ids.caller(context.invocation_metadata())
        with timed_call() as times, ids.request_context(*caller) as request_id:
            await _send_request_id(context, request_id)
            try:
                tp.check_model(state, request.model_name, request.model_version)
                requested = [o.name for o in request.outputs]
                if request.model_name in AUX_MODELS:
                    tensors = decode_inputs(request)
                    outputs = await run_aux(state, request.model_name, tensors, requested)
                else:
                    reqs = await tp.parse_request(
                        state, request.model_name, decode_inputs(request), request.id
                    )
                    outputs = select_outputs(
                        await tr.infer(state, reqs), requested, request.model_name
                    )
            except Exception as exc:
                error = exc
        if error is None:
            state.metrics.count_request("grpc:ModelInfer", "OK")
            response = _response(request.model_name, request.id, outputs)
            bytes_out(times, state.metrics)  # handed to grpc as it returns
            return response
        code, message = _status(error)
        state.metrics.count_request("grpc:ModelInfer", code.name)
        await context.abort(code, message)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[pb.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Requests are served concurrently; the RPC ends once the client half-closed and all are answered."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        producers = 1  # the reader, then one per request; each puts _DONE when it is through
        given, trace = ids.caller(context.invocation_metadata())
        request_id = ids.usable_request_id(given)
        await _send_request_id(context, request_id)

        async def read() -> None:
            nonlocal producers
            # in this task's context (its request tasks copy it, sharing the id's numbering), gone with the task
            ids.enter_request(request_id, trace)
            try:
                async for request in request_iterator:
                    producers += 1
                    task = asyncio.create_task(self._serve_stream_request(request, queue))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:
                queue.put_nowait(_DONE)

        reader = asyncio.create_task(read())
        try:
            while producers:
                item = await queue.get()
                if item is _DONE:
                    producers -= 1
                else:
                    yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _serve_stream_request(
        self, request: pb.ModelInferRequest, queue: asyncio.Queue
    ) -> None:
        """Answer one request of a stream into `queue` (PROTOCOL §4 decoupled semantics); ends with _DONE."""
        state, model, started = self.state, request.model_name, False
        times = start_timed_call()  # this request's task only
        params = request.parameters
        empty_final = (
            "triton_enable_empty_final_response" in params
            and params["triton_enable_empty_final_response"].bool_param
        )
        # the BLS sends its data responses, then a flag-only final (sent only when the client asked for it)
        flag_only_final = model == BLS and state.config.decoupled
        try:
            tp.check_model(state, model, request.model_version)
            if model in AUX_MODELS:  # one response, the final one
                outputs = await run_aux(
                    state, model, decode_inputs(request), [o.name for o in request.outputs]
                )
                response = _response(model, request.id, outputs, True)
                queue.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
                state.metrics.count_request("grpc:ModelStreamInfer", "OK")
                return
            reqs = await tp.parse_request(state, model, decode_inputs(request), request.id)
            if len(reqs) != 1:
                raise ValueError(
                    f"text_input: ModelStreamInfer takes batch size 1, got {len(reqs)}"
                )
            requested = [o.name for o in request.outputs]
            accumulate = model == BLS and state.config.accumulate_tokens
            async for tensors, last in tr.stream(state, reqs[0], accumulate):
                started = True
                outputs = select_outputs(tensors, requested, model)
                final = last and not flag_only_final
                queue.put_nowait(
                    pb.ModelStreamInferResponse(
                        infer_response=_response(model, request.id, outputs, final)
                    )
                )
                bytes_out(times, state.metrics)  # queued for the stream's writer
            if flag_only_final and empty_final:
                queue.put_nowait(
                    pb.ModelStreamInferResponse(
                        infer_response=pb.ModelInferResponse(
                            model_name=model,
                            model_version=MODEL_VERSION,
                            id=request.id,
                            parameters={
                                "triton_final_response": pb.InferParameter(bool_param=True)
                            },
                        )
                    )
                )
            state.metrics.count_request("grpc:ModelStreamInfer", "OK")
        except Exception as exc:
            code, message = _status(exc)
            state.metrics.count_request("grpc:ModelStreamInfer", code.name)
            resp = pb.ModelInferResponse(id=request.id)
            if started:  # an error of the model itself also names the model and ends the request
                resp = pb.ModelInferResponse(
                    model_name=model,
                    model_version=MODEL_VERSION,
                    id=request.id,
                    parameters={"triton_final_response": pb.InferParameter(bool_param=True)},
                )
            queue.put_nowait(
                pb.ModelStreamInferResponse(error_message=message, infer_response=resp)
            )
        finally:
            queue.put_nowait(_DONE)


async def start_grpc_server(
    state: ServerState, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """Start the KServe gRPC service; port 0 picks a free one. Returns (server, bound port)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", state.config.max_request_bytes),
        ("grpc.max_send_message_length", 2**31 - 1),
    ]
    interceptors = [UnexpectedErrors(), RestrictedProtocols(state.config.grpc_restrictions)]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(TritonServicer(state), server)
    cfg = state.config
    if cfg.grpc_use_ssl:

        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_server_credentials(
            [(read(cfg.grpc_server_key), read(cfg.grpc_server_cert))],
            root_certificates=read(cfg.grpc_root_cert) if cfg.grpc_root_cert else None,
            require_client_auth=cfg.grpc_use_ssl_mutual,
        )
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the gRPC server to {host}:{port}")
    await server.start()
    return server, bound
