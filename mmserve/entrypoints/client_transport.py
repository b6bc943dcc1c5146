"""How `mmserve client` sends its request: KServe v2 gRPC through tritonclient (ModelInfer, or ModelStreamInfer
when streaming), or the Triton generate / generate_stream endpoint over HTTP. Each returns one list of beam texts
per response (a ClientError in place of a response that failed mid-stream)."""

from __future__ import annotations

import json
import queue

import numpy as np

from mmserve.entrypoints.client_request import ClientError, Request, to_png_data_uri


def _decode_beams(arr: np.ndarray | None) -> list[str]:
    if arr is None:
        raise ClientError("the response has no text_output")
    return [
        x.decode("utf-8", errors="replace") if isinstance(x, bytes) else str(x)
        for x in arr.reshape(-1)
    ]


def send_grpc(
    url: str, req: Request, streaming: bool, timeout: float, verbose: bool
) -> list[list[str]]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    inputs = []
    for name, arr in req.tensors:
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    responses: list[list[str]] = []
    try:
        with grpcclient.InferenceServerClient(url, verbose=verbose) as client:
            if not streaming:
                result = client.infer(
                    req.model_name, inputs, outputs=outputs, client_timeout=timeout
                )
                return [_decode_beams(result.as_numpy("text_output"))]
            results: queue.Queue = queue.Queue()
            client.start_stream(
                callback=lambda result, error: results.put((result, error)), stream_timeout=timeout
            )
            client.async_stream_infer(req.model_name, inputs, outputs=outputs)
            client.stop_stream(cancel_requests=False)  # blocks until the server ends the stream
    except InferenceServerException as e:
        raise ClientError(_grpc_message(e)) from None
    while not results.empty():
        result, error = results.get_nowait()
        if error is not None:
            responses.append(ClientError(_grpc_message(error)))
            break
        responses.append(_decode_beams(result.as_numpy("text_output")))
    return responses


def _grpc_message(e) -> str:
    return f"{e.status()}: {e.message()}" if e.status() else str(e.message())


def _json_value(arr: np.ndarray):
    values = [x.decode("utf-8") if isinstance(x, bytes) else x.item() for x in arr.reshape(-1)]
    return values[0] if len(values) == 1 else values


def send_http(url: str, req: Request, streaming: bool, timeout: float) -> list[list[str]]:
    import httpx

    body = {name: _json_value(arr) for name, arr in req.tensors}
    if req.images:
        uris = [to_png_data_uri(im) for im in req.images]
        body["image_url_input"] = uris[0] if len(uris) == 1 else uris
    base = url if "://" in url else f"http://{url}"
    endpoint = f"{base.rstrip('/')}/v2/models/{req.model_name}/{'generate_stream' if streaming else 'generate'}"

    def beams(obj: dict) -> list[str]:
        if "error" in obj:
            raise ClientError(str(obj["error"]))
        if "text_output" not in obj:
            raise ClientError("the response has no text_output")
        text = obj["text_output"]
        return list(text) if isinstance(text, list) else [text]

    try:
        with httpx.Client(timeout=timeout) as client:
            if not streaming:
                resp = client.post(endpoint, json=body)
                obj = _http_json(resp)
                return [beams(obj)]
            responses: list = []
            with client.stream("POST", endpoint, json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    _http_json(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    try:
                        responses.append(beams(json.loads(line[5:])))
                    except ClientError as e:
                        responses.append(e)
                        break
            return responses
    except httpx.HTTPError as e:
        raise ClientError(f"HTTP request to {endpoint} failed: {e}") from None


def _http_json(resp) -> dict:
    try:
        obj = resp.json()
    except ValueError:
        raise ClientError(f"HTTP {resp.status_code}: {resp.text[:500]}") from None
    if resp.status_code != 200:
        raise ClientError(
            f"HTTP {resp.status_code}: {obj.get('error', obj) if isinstance(obj, dict) else obj}"
        )
    return obj
