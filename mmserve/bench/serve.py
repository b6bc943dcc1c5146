"""`mmserve bench serve`: a load generator against one running server (only the given URL).

Protocols: `triton-http` (generate_stream SSE), `triton-grpc` (ModelStreamInfer) and `openai` (chat
completions stream). Sweeps Poisson request rates and closed-loop concurrencies; each point sends at most
`num_requests` requests and launches none after `max_duration_s` (each request is cut at `request_timeout_s`).
Per point: TTFT, inter-token latency (gaps between streamed chunks), TPOT and end-to-end p50/p99, output
tok/s and requests/s. The transformers baseline, when asked for, runs in this process as a static-batching
server emulation: for concurrency C, the same requests go through `generate` in batches of C, each prompt the
user text in the checkpoint's own chat template (as the OpenAI frontend builds it).
Settings: bench/serve_config.py; sending: bench/serve_requests.py; what is measured: bench/serve_metrics.py.
"""

from __future__ import annotations

import asyncio
import math
import traceback
from dataclasses import asdict
from typing import Any

from tqdm import tqdm

from mmserve.bench.serve_config import ServeConfig
from mmserve.bench.serve_metrics import Record, summarize
from mmserve.bench.serve_requests import data_uri, run_point
from mmserve.bench.workload import (
    PromptTemplate,
    environment,
    make_filler,
    make_images,
    model_record,
    now,
)


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
    warm = [data_uri(im) for im in make_images(cfg.warmup, cfg.image_size, seed=cfg.seed + 999_983)]
    if warm:
        records, _, _ = asyncio.run(run_point(cfg, text, warm, math.inf, 1, "warmup"))
        if not any(r.ok for r in records):
            raise RuntimeError(f"warmup requests to {cfg.url} failed: {records[0].error}")
    points = [(r, None) for r in cfg.request_rates] + [(math.inf, c) for c in cfg.concurrencies]
    rate_sweep, conc_sweep = [], []
    for k, (rate, conc) in enumerate(points):
        images = _point_images(cfg, k)
        uris = [data_uri(im) for im in images]
        label = f"rate={rate:g}" if conc is None else f"concurrency={conc}"
        records, duration, truncated = asyncio.run(run_point(cfg, text, uris, rate, conc, label))
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
