"""How `mmserve bench serve` sends load: one streamed request per protocol (Triton HTTP generate_stream SSE,
Triton gRPC ModelStreamInfer, OpenAI chat completions stream), timing each streamed chunk, and one sweep point's
requests (Poisson arrivals at a rate, or a cap on concurrent requests; none launched past max_duration_s).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from typing import Any

from tqdm import tqdm

from mmserve.bench.serve_config import ServeConfig
from mmserve.bench.serve_metrics import Record
from mmserve.bench.serve_workload import ServeRequest
from mmserve.bench.workload import now


async def _sse_events(response: Any):
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


async def _raise_for_status(response: Any) -> None:
    if response.status_code != 200:
        raise RuntimeError(
            f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
        )


async def _triton_http(
    client: Any, cfg: ServeConfig, req: ServeRequest, rec: Record, t0: float
) -> None:
    body: dict[str, Any] = {
        "text_input": req.text,
        "max_tokens": req.output_len,
        "min_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
    }
    if req.image_uris:
        body["image_url_input"] = list(req.image_uris)
    async with client.stream(
        "POST", f"{cfg.url}/v2/models/{cfg.model_name}/generate_stream", json=body
    ) as resp:
        await _raise_for_status(resp)
        async for data in _sse_events(resp):
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("text_output"):
                rec.chunk_times.append(now() - t0)
    rec.output_tokens = req.output_len  # min_tokens = max_tokens fixes the count


async def _openai(client: Any, cfg: ServeConfig, req: ServeRequest, rec: Record, t0: float) -> None:
    pictures = [{"type": "image_url", "image_url": {"url": u}} for u in req.image_uris]
    body = {
        "model": cfg.model_name,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": req.output_len,
        "min_tokens": req.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "messages": [
            {
                "role": "user",
                "content": [*pictures, {"type": "text", "text": req.text}],
            }
        ],
    }
    async with client.stream("POST", f"{cfg.url}/v1/chat/completions", json=body) as resp:
        await _raise_for_status(resp)
        async for data in _sse_events(resp):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(str(chunk["error"]))
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                rec.chunk_times.append(now() - t0)
            if chunk.get("usage"):
                rec.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
    rec.output_tokens = rec.output_tokens or len(rec.chunk_times)


async def _triton_grpc(
    client: Any, cfg: ServeConfig, req: ServeRequest, rec: Record, t0: float
) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: Any, dtype: Any) -> Any:
        arr = np.array([value if isinstance(value, list) else [value]], dtype=dtype)
        inp = grpcclient.InferInput(
            name,
            list(arr.shape),
            "BYTES"
            if dtype is object
            else {np.int32: "INT32", np.float32: "FP32", np.bool_: "BOOL"}[dtype],
        )
        inp.set_data_from_numpy(arr)
        return inp

    inputs = [
        tensor("text_input", req.text.encode(), object),
        tensor("max_tokens", req.output_len, np.int32),
        tensor("min_tokens", req.output_len, np.int32),
        tensor("temperature", 0.0, np.float32),
        tensor("stream", True, np.bool_),
    ]
    if req.image_uris:
        inputs.append(tensor("image_url_input", [u.encode() for u in req.image_uris], object))

    async def requests():
        yield {
            "model_name": cfg.model_name,
            "inputs": inputs,
            "enable_empty_final_response": True,
            "outputs": [grpcclient.InferRequestedOutput("text_output")],
        }

    async for result, error in client.stream_infer(requests(), headers=cfg.headers or None):
        if error is not None:
            raise RuntimeError(str(error))
        out = result.as_numpy("text_output")
        if out is not None and out.size and any(bytes(x) for x in out.reshape(-1)):
            rec.chunk_times.append(now() - t0)
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    rec.output_tokens = req.output_len


_SENDERS = {"triton-http": _triton_http, "triton-grpc": _triton_grpc, "openai": _openai}


def _client(cfg: ServeConfig) -> Any:
    if cfg.protocol == "triton-grpc":
        import tritonclient.grpc.aio as grpcaio

        return grpcaio.InferenceServerClient(cfg.url)
    import httpx

    # trust_env=False: no proxy from the environment can redirect the load elsewhere.
    return httpx.AsyncClient(
        timeout=cfg.request_timeout_s,
        trust_env=False,
        headers=cfg.headers,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def _close(client: Any) -> None:
    await (
        client.close()
        if hasattr(client, "close") and not hasattr(client, "aclose")
        else client.aclose()
    )


async def _send(client: Any, cfg: ServeConfig, req: ServeRequest) -> Record:
    rec = Record()
    t0 = now()
    try:
        await asyncio.wait_for(
            _SENDERS[cfg.protocol](client, cfg, req, rec, t0), cfg.request_timeout_s
        )
        rec.ok = bool(rec.chunk_times)
        rec.error = None if rec.ok else "no streamed output"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:500]
    rec.e2e = now() - t0
    return rec


async def run_point(
    cfg: ServeConfig,
    requests: list[ServeRequest],
    rate: float,
    concurrency: int | None,
    desc: str,
) -> tuple[list[Record], float, bool]:
    """One sweep point: each of `requests`, Poisson arrivals at `rate` (inf: all at once), at most `concurrency`
    in flight (None: no cap), none launched after max_duration_s. Returns the launched requests' records, the
    point's wall time in seconds and whether max_duration_s cut it short."""
    client = _client(cfg)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(cfg.seed)
    bar = tqdm(total=len(requests), desc=desc, leave=False)

    async def one(req: ServeRequest) -> Record:
        try:
            return await _send(client, cfg, req)
        finally:
            bar.update(1)
            if sem is not None:
                sem.release()

    tasks: list[asyncio.Task] = []
    truncated = False
    start = now()
    try:
        for req in requests:
            if not math.isinf(rate):
                await asyncio.sleep(rng.expovariate(rate))
            if sem is not None:
                try:
                    await asyncio.wait_for(
                        sem.acquire(), max(0.0, cfg.max_duration_s - (now() - start))
                    )
                except TimeoutError:
                    truncated = True
                    break
            if now() - start > cfg.max_duration_s:
                truncated = True
                if sem is not None:
                    sem.release()
                break
            tasks.append(asyncio.create_task(one(req)))
        records = list(await asyncio.gather(*tasks))
    finally:
        bar.close()
        await _close(client)
    return records, now() - start, truncated
