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
from mmserve.bench.serve_phases import phase_breakdown, phase_quantiles, scrape_phases
from mmserve.bench.serve_requests import run_point
from mmserve.bench.serve_workload import (
    ServeRequest,
    dataset_requests,
    peak_concurrency,
    point_images,
    synthetic_requests,
    warmup_requests,
)
from mmserve.bench.server_info import resolve_model_name, server_label
from mmserve.bench.workload import (
    PromptTemplate,
    environment,
    make_filler,
    make_images,
    model_record,
    now,
)


def _points_requests(
    cfg: ServeConfig, template: PromptTemplate | None, n_points: int
) -> tuple[list[list[ServeRequest]], dict[str, Any]]:
    """Each sweep point's requests, and what the result says of them: synthetic (new pictures per point) or the
    --dataset file's first num_requests lines (the same for every point)."""
    tokenizer = template.tokenizer if template else None
    if cfg.dataset is None:
        text = make_filler(tokenizer, cfg.input_len)
        points = [synthetic_requests(cfg, text, k) for k in range(n_points)]
        return points, {"source": "synthetic"}
    from mmserve.bench.dataset import load_dataset

    count = (lambda t: len(tokenizer(t, add_special_tokens=False).input_ids)) if tokenizer else None
    lines = load_dataset(cfg.dataset, cfg.num_requests, count)
    fixed = cfg.output_len if cfg.output_len_fixed else None
    requests = dataset_requests(lines, fixed, cfg.output_len)
    record = {
        "source": "dataset",
        "dataset": cfg.dataset,
        "distinct_lines": len({r.line for r in lines}),
        "cycled": len({r.line for r in lines}) < len(lines),
        "output_len_from": "--output-len" if cfg.output_len_fixed else "dataset",
        "pictures_per_request": sum(len(r.images) for r in lines) / len(lines),
    }
    return [requests] * n_points, record


def run_serve(cfg: ServeConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Warm up on every request shape of the sweeps, run the rate sweep then the concurrency sweep; return the
    result record."""
    template = model_dir = None
    if cfg.source is not None:
        model_dir = cfg.source.resolve()
        template = PromptTemplate(model_dir)
    cfg.model_name = cfg.model_name or asyncio.run(resolve_model_name(cfg))
    label = cfg.label or asyncio.run(server_label(cfg))
    errors: list[str] = []
    points = [(r, None) for r in cfg.request_rates] + [(math.inf, c) for c in cfg.concurrencies]
    point_requests, workload = _points_requests(cfg, template, len(points))
    warm = warmup_requests(cfg, [r for reqs in point_requests for r in reqs])
    if warm:
        records, _, _ = asyncio.run(run_point(cfg, warm, math.inf, peak_concurrency(cfg), "warmup"))
        if not any(r.ok for r in records):
            raise RuntimeError(f"warmup requests to {cfg.url} failed: {records[0].error}")
    workload |= {"warmup_requests": len(warm), "warmup_concurrency": peak_concurrency(cfg)}
    rate_sweep, conc_sweep = [], []
    for (rate, conc), requests in zip(points, point_requests, strict=True):
        desc = f"rate={rate:g}" if conc is None else f"concurrency={conc}"
        before = _scrape(cfg)
        records, duration, truncated = asyncio.run(run_point(cfg, requests, rate, conc, desc))
        row = {
            "request_rate": "inf" if math.isinf(rate) else rate,
            "concurrency": conc,
            "truncated": truncated,
            "server": summarize(records, duration, cfg.goodput),
            "phases": _phases(before, _scrape(cfg)),
        }
        (rate_sweep if conc is None else conc_sweep).append(row)
    if cfg.baseline == "hf" and conc_sweep:
        try:
            assert model_dir is not None and template is not None
            text = point_requests[0][0].text
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
        "labels": {"server": label, "hf": "transformers"},
        "model": {
            **model_record(cfg.source, model_dir),
            "served_name": cfg.model_name,
            "input_len_exact": template is not None,
        },
        "workload": workload,
        "results": {"rate_sweep": rate_sweep, "concurrency_sweep": conc_sweep},
        "errors": errors,
    }


def _scrape(cfg: ServeConfig) -> dict | None:
    """The server's request-phase histogram (mmserve's /metrics beside an HTTP API); None where there is none:
    gRPC (its metrics port is another), a server without the metric, or /metrics refused."""
    if cfg.protocol == "triton-grpc":
        return None
    try:
        phases = scrape_phases(cfg.url.rstrip("/") + "/metrics", timeout=10.0)
    except (OSError, ValueError):
        return None
    return phases or None


def _phases(before: dict | None, after: dict | None) -> dict[str, Any] | None:
    """Mean and p50 ms per phase of the point's requests, from the server's histogram before and after it."""
    if before is None or after is None:
        return None
    stats = {"mean_ms": phase_breakdown(before, after), "p50_ms": phase_quantiles(before, after)}
    return {k: {p: None if math.isnan(v) else v for p, v in d.items()} for k, d in stats.items()}


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
    return summarize(records, now() - start, cfg.goodput)


def _hf_sweep(
    cfg: ServeConfig, model_dir: str, prompt: str, rows: list[dict], first_index: int
) -> None:
    from mmserve.bench.hf_baseline import HFBaseline

    hf = HFBaseline(model_dir, cfg.device, cfg.dtype, cfg.hf_attn)
    try:
        for c in sorted({row["concurrency"] for row in rows}):  # warm-up: each batch size
            hf.generate([prompt] * c, make_images(c, cfg.image_size, seed=7), 2)
        for k, row in enumerate(rows):
            row["hf"] = _hf_point(
                hf, cfg, prompt, point_images(cfg, first_index + k), row["concurrency"]
            )
            m, h = row["server"], row["hf"]
            if m["completed"] and h["completed"] and m["ttft_ms"] and h["ttft_ms"]:
                row["ratio"] = {
                    "output_tok_s": m["output_tok_s"] / h["output_tok_s"],
                    "requests_per_s": m["requests_per_s"] / h["requests_per_s"],
                    "ttft_p50": m["ttft_ms"]["p50"] / h["ttft_ms"]["p50"],
                }
    finally:
        hf.close()
