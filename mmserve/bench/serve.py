"""`mmserve bench serve`: a load generator against one running server (only the given URL).

Protocols: `triton-http` (generate_stream SSE), `triton-grpc` (ModelStreamInfer) and `openai` (chat
completions stream). Sweeps Poisson request rates and closed-loop concurrencies; each point sends at most
`num_requests` requests and launches none after `max_duration_s` (each request is cut at `request_timeout_s`).
Per point: TTFT, inter-token latency (gaps between streamed chunks), TPOT and end-to-end p50/p99, output
tok/s and requests/s. The transformers baseline, when asked for, runs in this process as a static-batching
server emulation: for concurrency C, the same requests go through `generate` in batches of C, each prompt the
user text in the checkpoint's own chat template (as the OpenAI frontend builds it).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import statistics
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from tqdm import tqdm

from mmserve.bench.workload import (
    ModelSource,
    PromptTemplate,
    environment,
    make_filler,
    make_images,
    model_record,
    now,
)

PROTOCOLS = ("triton-http", "triton-grpc", "openai")


@dataclass
class ServeConfig:
    """Settings of one load-generator run."""

    url: str  # http://HOST:PORT (HTTP protocols) or HOST:PORT (gRPC)
    protocol: str = "triton-http"  # triton-http | triton-grpc | openai
    model_name: str | None = None  # triton: "ensemble"; openai: the server's first model
    request_rates: list[float] = field(
        default_factory=lambda: [1.0, 4.0, 16.0]
    )  # req/s; inf = all at once
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_requests: int = 64  # per sweep point
    input_len: int = 128  # user text tokens (exact with a tokenizer, else words)
    output_len: int = 128  # forced: min_tokens = max_tokens (+ ignore_eos for openai)
    max_duration_s: float = 120.0  # no new request of a point after this
    request_timeout_s: float = 300.0
    warmup: int = 2  # untimed requests before the sweeps
    image_size: int = 336  # side of the synthetic images
    unique_images: bool = True  # distinct images: no encoder/prefix cache hits
    source: ModelSource | None = None  # tokenizer for exact input_len; needed by the hf baseline
    baseline: str = "none"  # hf | none
    device: str = "cpu"  # hf baseline only
    dtype: str = "float32"  # hf baseline only
    hf_attn: str | None = None  # hf baseline: attn_implementation (None = its default)
    seed: int = 0
    # sent with every request: HTTP headers, or gRPC metadata (a Triton server started with
    # --grpc-restricted-protocol wants `triton-grpc-protocol-<key>`)
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.num_requests < 1 or self.output_len < 1 or self.input_len < 0:
            raise ValueError("need num_requests >= 1, output_len >= 1, input_len >= 0")
        if any(r <= 0 for r in self.request_rates) or any(c < 1 for c in self.concurrencies):
            raise ValueError("request rates must be > 0 and concurrencies >= 1")
        if self.max_duration_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("max_duration_s and request_timeout_s must be > 0")
        if self.baseline not in ("hf", "none"):
            raise ValueError(f"baseline must be hf or none, got {self.baseline!r}")
        if self.baseline == "hf" and self.source is None:
            raise ValueError(
                "--baseline hf needs --model or --preset (the checkpoint the server runs)"
            )
        if self.protocol == "triton-grpc":
            self.url = self.url.split("://", 1)[-1].rstrip("/")
        elif urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"{self.protocol} needs an http(s):// URL, got {self.url!r}")
        else:
            self.url = self.url.rstrip("/")


@dataclass
class Record:
    """What one request measured; times are seconds since its send."""

    ok: bool = False
    chunk_times: list[float] = field(default_factory=list)  # each streamed piece of text
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None


# ---- one request per protocol ---------------------------------------------------------------


def _data_uri(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def _sse_events(response: Any):
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


async def _triton_http(
    client: Any, cfg: ServeConfig, text: str, image_uri: str, rec: Record, t0: float
) -> None:
    body = {
        "text_input": text,
        "image_url_input": image_uri,
        "max_tokens": cfg.output_len,
        "min_tokens": cfg.output_len,
        "temperature": 0.0,
        "stream": True,
    }
    async with client.stream(
        "POST", f"{cfg.url}/v2/models/{cfg.model_name}/generate_stream", json=body
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
            )
        async for data in _sse_events(resp):
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("text_output"):
                rec.chunk_times.append(now() - t0)
    rec.output_tokens = cfg.output_len  # min_tokens = max_tokens fixes the count


async def _openai(
    client: Any, cfg: ServeConfig, text: str, image_uri: str, rec: Record, t0: float
) -> None:
    body = {
        "model": cfg.model_name,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": cfg.output_len,
        "min_tokens": cfg.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_uri}},
                    {"type": "text", "text": text},
                ],
            }
        ],
    }
    async with client.stream("POST", f"{cfg.url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(
                f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
            )
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
    client: Any, cfg: ServeConfig, text: str, image_uri: str, rec: Record, t0: float
) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name: str, value: Any, dtype: Any) -> Any:
        arr = np.array([[value]], dtype=dtype)
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
        tensor("text_input", text.encode(), object),
        tensor("image_url_input", image_uri.encode(), object),
        tensor("max_tokens", cfg.output_len, np.int32),
        tensor("min_tokens", cfg.output_len, np.int32),
        tensor("temperature", 0.0, np.float32),
        tensor("stream", True, np.bool_),
    ]

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
    rec.output_tokens = cfg.output_len


_SENDERS = {"triton-http": _triton_http, "triton-grpc": _triton_grpc, "openai": _openai}


# ---- load generation ------------------------------------------------------------------------


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


async def _send(client: Any, cfg: ServeConfig, text: str, image_uri: str) -> Record:
    rec = Record()
    t0 = now()
    try:
        await asyncio.wait_for(
            _SENDERS[cfg.protocol](client, cfg, text, image_uri, rec, t0), cfg.request_timeout_s
        )
        rec.ok = bool(rec.chunk_times)
        rec.error = None if rec.ok else "no streamed output"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:500]
    rec.e2e = now() - t0
    return rec


async def _run_point(
    cfg: ServeConfig, text: str, uris: list[str], rate: float, concurrency: int | None, desc: str
) -> tuple[list[Record], float, bool]:
    client = _client(cfg)
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(cfg.seed)
    bar = tqdm(total=len(uris), desc=desc, leave=False)

    async def one(uri: str) -> Record:
        try:
            return await _send(client, cfg, text, uri)
        finally:
            bar.update(1)
            if sem is not None:
                sem.release()

    tasks: list[asyncio.Task] = []
    truncated = False
    start = now()
    try:
        for uri in uris:
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
            tasks.append(asyncio.create_task(one(uri)))
        records = list(await asyncio.gather(*tasks))
    finally:
        bar.close()
        await _close(client)
    return records, now() - start, truncated


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    s = sorted(xs)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "p50": pct(50), "p99": pct(99), "max": s[-1]}


def summarize(records: list[Record], duration_s: float) -> dict[str, Any]:
    """Latency percentiles (ms) over completed requests; rates over the point's wall time."""
    ok = [r for r in records if r.ok]
    ttft = [r.chunk_times[0] * 1e3 for r in ok]
    itl = [
        (b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
    ]
    tpot = [
        (r.e2e - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in records if r.error})
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration_s,
        "ttft_ms": _stats(ttft),
        "itl_ms": _stats(itl),
        "tpot_ms": _stats(tpot),
        "e2e_ms": _stats([r.e2e * 1e3 for r in ok]),
        "errors": errors[:5],
    }


# ---- the transformers emulation -------------------------------------------------------------


def _hf_point(
    hf: Any, cfg: ServeConfig, prompt: str, images: list[Any], concurrency: int
) -> dict[str, Any]:
    """Closed loop with `concurrency` clients against a static-batching transformers server."""
    records: list[Record] = []
    start = now()
    for i in tqdm(
        range(0, len(images), concurrency), desc=f"transformers c={concurrency}", leave=False
    ):
        if now() - start > cfg.max_duration_s:
            break
        batch = images[i : i + concurrency]
        t = hf.generate([prompt] * len(batch), batch, cfg.output_len, stream=True)
        records += [
            Record(
                ok=True,
                chunk_times=list(t.token_times_s),
                e2e=t.total_s,
                output_tokens=t.new_tokens,
            )
            for _ in batch
        ]
    return summarize(records, now() - start)


# ---- the run --------------------------------------------------------------------------------


async def _resolve_model_name(cfg: ServeConfig) -> str:
    if cfg.protocol != "openai":
        return "ensemble"
    import httpx

    async with httpx.AsyncClient(timeout=30, trust_env=False, headers=cfg.headers) as client:
        resp = await client.get(f"{cfg.url}/v1/models")
        resp.raise_for_status()
        ids = [m["id"] for m in resp.json()["data"]]
        from mmserve.entrypoints.state import TRITON_MODEL_NAMES

        own = [i for i in ids if i not in TRITON_MODEL_NAMES]  # prefer the checkpoint's own name
        return (own or ids)[0]


def _point_images(cfg: ServeConfig, index: int) -> list[Any]:
    n = cfg.num_requests if cfg.unique_images else 1
    images = make_images(n, cfg.image_size, seed=cfg.seed * 1_000_003 + index * 10_007)
    return images if cfg.unique_images else images * cfg.num_requests


def run_serve(cfg: ServeConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Warm up, run the rate sweep then the concurrency sweep; return the result record."""
    template = model_dir = None
    if cfg.source is not None:
        model_dir = cfg.source.resolve()
        template = PromptTemplate(model_dir)
    text = make_filler(template.tokenizer if template else None, cfg.input_len)
    cfg.model_name = cfg.model_name or asyncio.run(_resolve_model_name(cfg))
    errors: list[str] = []
    warm = [
        _data_uri(im) for im in make_images(cfg.warmup, cfg.image_size, seed=cfg.seed + 999_983)
    ]
    if warm:
        records, _, _ = asyncio.run(_run_point(cfg, text, warm, math.inf, 1, "warmup"))
        if not any(r.ok for r in records):
            raise RuntimeError(f"warmup requests to {cfg.url} failed: {records[0].error}")
    points = [(r, None) for r in cfg.request_rates] + [(math.inf, c) for c in cfg.concurrencies]
    rate_sweep, conc_sweep = [], []
    for k, (rate, conc) in enumerate(points):
        images = _point_images(cfg, k)
        uris = [_data_uri(im) for im in images]
        label = f"rate={rate:g}" if conc is None else f"concurrency={conc}"
        records, duration, truncated = asyncio.run(_run_point(cfg, text, uris, rate, conc, label))
        row = {
            "request_rate": "inf" if math.isinf(rate) else rate,
            "concurrency": conc,
            "truncated": truncated,
            "mmserve": summarize(records, duration),
        }
        (rate_sweep if conc is None else conc_sweep).append(row)
    if cfg.baseline == "hf" and conc_sweep:
        try:
            assert model_dir is not None and template is not None
            _hf_sweep(
                cfg, model_dir, template.wrap(text), conc_sweep, first_index=len(cfg.request_rates)
            )
        except Exception:
            errors.append("hf: " + traceback.format_exc())
    env = environment(cfg.device, argv)  # the machine the load generator ran on
    config = asdict(cfg) | {
        "headers": {k: "<redacted>" for k in cfg.headers}
    }  # no credentials in results
    return {
        "schema": "mmserve-bench/1",
        "bench": "serve",
        "env": env,
        "config": config,
        "model": {
            **model_record(cfg.source, model_dir),
            "served_name": cfg.model_name,
            "input_len_exact": template is not None,
        },
        "results": {"rate_sweep": rate_sweep, "concurrency_sweep": conc_sweep},
        "errors": errors,
    }


def _hf_sweep(
    cfg: ServeConfig, model_dir: str, prompt: str, rows: list[dict], first_index: int
) -> None:
    from mmserve.bench.hf_baseline import HFBaseline

    hf = HFBaseline(model_dir, cfg.device, cfg.dtype, cfg.hf_attn)
    try:
        hf.generate([prompt], make_images(1, cfg.image_size, seed=7), 2)  # warmup
        for k, row in enumerate(rows):
            row["hf"] = _hf_point(
                hf, cfg, prompt, _point_images(cfg, first_index + k), row["concurrency"]
            )
            m, h = row["mmserve"], row["hf"]
            if m["completed"] and h["completed"] and m["ttft_ms"] and h["ttft_ms"]:
                row["ratio"] = {
                    "output_tok_s": m["output_tok_s"] / h["output_tok_s"],
                    "requests_per_s": m["requests_per_s"] / h["requests_per_s"],
                    "ttft_p50": m["ttft_ms"]["p50"] / h["ttft_ms"]["p50"],
                }
    finally:
        hf.close()
