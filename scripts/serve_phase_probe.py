"""Where a served request's first token goes: send the issue's request shape (one PNG picture as a client sends it,
a ~24-token question, 8 new tokens) over Triton generate_stream and OpenAI streaming chat, read the server's
`mmserve_request_phase_seconds` before and after, and print each phase's mean and estimated p50 (ms) beside the
client's time to first token. Sequential by default; `--rate R --concurrency C` sends Poisson arrivals at R req/s,
at most C in flight, and adds the client's TTFT and inter-token p99.

    .venv/bin/python scripts/serve_phase_probe.py                  # starts `mmserve serve` on the demo model
    .venv/bin/python scripts/serve_phase_probe.py --url http://127.0.0.1:8000 --requests 50
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np
from PIL import Image

from mmserve.bench.serve_phases import phase_breakdown, phase_quantiles, scrape_phases
from mmserve.core.outputs import PHASES
from mmserve.testing import default_model_dir, make_test_image

QUESTION = "What is shown in this picture? Describe the colours, the shapes and where each one lies, in a few words."


def picture_uri(seed: int, size: int) -> str:
    """A distinct PNG per seed (shapes on a gradient, with sensor-like noise so it compresses like a photo)."""
    rng = np.random.default_rng(seed)
    pixels = np.asarray(make_test_image(seed, (size, size)), dtype=np.int16)
    pixels = np.clip(pixels + rng.integers(-6, 7, pixels.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def request_of(api: str, uri: str, max_tokens: int) -> tuple[str, dict]:
    if api == "triton":
        body = {
            "text_input": QUESTION,
            "image_url_input": uri,
            "max_tokens": max_tokens,
            "stream": True,
        }
        return "/v2/models/ensemble/generate_stream", body
    content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": QUESTION}]
    body = {
        "model": "ensemble",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    return "/v1/chat/completions", body


async def one(
    client: httpx.AsyncClient, api: str, uri: str, max_tokens: int
) -> tuple[float, list[float]]:
    """(time to the first SSE event, gaps between the later events) in seconds."""
    path, body = request_of(api, uri, max_tokens)
    start = time.perf_counter()
    events: list[float] = []
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{path}: {resp.status_code} {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                events.append(time.perf_counter())
    return events[0] - start, [b - a for a, b in zip(events, events[1:])]


async def run_api(url: str, api: str, args: argparse.Namespace, seed0: int) -> dict:
    limits = httpx.Limits(max_connections=max(args.concurrency, 1) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        for i in range(args.warmup):
            await one(client, api, picture_uri(seed0 - 1 - i, args.size), args.max_tokens)
        uris = [picture_uri(seed0 + i, args.size) for i in range(args.requests)]
        before = scrape_phases(f"{url}/metrics")
        started = time.perf_counter()
        if args.rate > 0:
            results = await _open_loop(client, api, uris, args)
        else:
            results = [await one(client, api, u, args.max_tokens) for u in uris]
        wall = time.perf_counter() - started
        after = scrape_phases(f"{url}/metrics")
    ttft = sorted(1000 * r[0] for r in results)
    gaps = sorted(1000 * g for r in results for g in r[1])
    return {
        "api": api,
        "requests": len(results),
        "wall_s": wall,
        "client_ttft_mean_ms": statistics.fmean(ttft),
        "client_ttft_p50_ms": statistics.median(ttft),
        "client_ttft_p99_ms": _pct(ttft, 0.99),
        "client_itl_p99_ms": _pct(gaps, 0.99) if gaps else float("nan"),
        "phase_mean_ms": phase_breakdown(before, after),
        "phase_p50_ms": phase_quantiles(before, after, 0.5),
        "phase_count": {
            p: after.get(p, {}).get("count", 0) - before.get(p, {}).get("count", 0) for p in PHASES
        },
    }


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


async def _open_loop(client: httpx.AsyncClient, api: str, uris: list[str], args) -> list:
    gate, rng, tasks = asyncio.Semaphore(args.concurrency), random.Random(0), []

    async def gated(uri: str):
        async with gate:
            return await one(client, api, uri, args.max_tokens)

    for uri in uris:
        tasks.append(asyncio.ensure_future(gated(uri)))
        await asyncio.sleep(rng.expovariate(args.rate))
    return list(await asyncio.gather(*tasks))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(model_dir: str, extra: list[str]):
    """`mmserve serve model_dir` on 127.0.0.1 (CPU) until the block ends; yields its base URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", model_dir, "--host", "127.0.0.1",
           "--http-port", str(port), "--grpc-port", str(_free_port()), "--device", "cpu",
           "--log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                    break
            if time.time() > deadline:
                raise RuntimeError("the server was not ready after 300 s")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def report(r: dict) -> str:
    lines = [
        f"{r['api']}: {r['requests']} requests in {r['wall_s']:.1f} s; client TTFT mean "
        f"{r['client_ttft_mean_ms']:.2f} ms, p50 {r['client_ttft_p50_ms']:.2f}, p99 {r['client_ttft_p99_ms']:.2f}; "
        f"ITL p99 {r['client_itl_p99_ms']:.2f} ms",
        f"  {'phase':<11}{'count':>7}{'mean ms':>10}{'~p50 ms':>10}",
    ]
    for p in PHASES:
        lines.append(
            f"  {p:<11}{r['phase_count'][p]:>7.0f}{r['phase_mean_ms'][p]:>10.3f}{r['phase_p50_ms'][p]:>10.3f}"
        )
    lines.append(f"  {'sum':<11}{'':>7}{sum(r['phase_mean_ms'].values()):>10.3f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one on the demo model)")
    ap.add_argument("--model", default=None, help="checkpoint to serve (default: the demo model)")
    ap.add_argument("--apis", default="triton,openai")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--size", type=int, default=336, help="picture side in pixels")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument(
        "--rate", type=float, default=0.0, help="requests per second (0: one after another)"
    )
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("serve_args", nargs="*", help="extra `mmserve serve` flags (after --)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(
            served(args.model or str(default_model_dir()), args.serve_args)
        )
        results = []
        for k, api in enumerate(args.apis.split(",")):
            results.append(asyncio.run(run_api(url, api, args, seed0=1000 * (k + 1))))
            print(report(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
