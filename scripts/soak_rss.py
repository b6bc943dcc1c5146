#!/usr/bin/env python3
"""Soak `mmserve serve` with image traffic and watch its resident memory (issue 30: is RSS growth caches filling to
their caps, or a leak?).

Starts `mmserve serve` on 127.0.0.1 (the embedded demo model unless --model is given; CPU by default), then for
--minutes sends a bounded stream of image requests over Triton HTTP generate / generate_stream and OpenAI chat
(streamed and not): mostly new pictures of new sizes, some exact repeats and some new questions about a recent
picture, some prompts with two pictures. Every --sample-s it reads the server's RSS, split into anonymous and file
pages (psutil if installed, else /proc/PID/status), and at the end prints the curve, the slope over the whole run and
the slope after warm-up (the last 1 - --warmup-fraction of the run, once the caches are full), and the server's
startup line of cache caps. Exit 1 when that slope exceeds --max-slope-mb-per-min, 2 when requests failed.

The caches fill at the pace of new pictures and prompt blocks: with the server's defaults the demo model's are full
after ~18k requests (the prefix-cache index: 69,905 blocks), ~8 minutes here; small caps fill in a short run
(`--encoder-cache-size 2048 --kv-cache-size-gb 0.05`). --server-arg passes any other `mmserve serve` flag.

The server runs under this file's `--child` mode, which calls glibc's malloc_trim(0) at the end of warm-up and at the
end (--no-trim-probe: plain `mmserve serve`, and the raw RSS slope is judged): what comes back is free memory the
allocator kept (1-3.6 MB/min of raw RSS slope in 8-14 minute runs of the CPU demo, all of it given back), and the
growth left between the two trimmed values is live memory, the slope judged. --tracemalloc DIR starts tracemalloc at
the end of warm-up and writes the lines whose allocations since then are still alive at the end (and the 5 largest
tracebacks) to DIR/growth.txt: what a Python-level leak or a cache still filling would show. Tracing slows the
server several-fold; allocations of C libraries (glibc arenas, torch's CPU allocator) do not appear there.

    python scripts/soak_rss.py --minutes 5
    python scripts/soak_rss.py --minutes 8 --encoder-cache-size 2048 --kv-cache-size-gb 0.05
    python scripts/soak_rss.py --minutes 3 --tracemalloc /tmp/soak
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

MB = 2**20
WORDS = (
    "what",
    "is",
    "in",
    "this",
    "picture",
    "describe",
    "the",
    "colors",
    "shapes",
    "left",
    "right",
    "count",
    "how",
    "many",
    "lines",
    "a",
    "short",
    "answer",
    "please",
    "where",
    "top",
    "bottom",
    "corner",
    "bright",
    "dark",
)


# ---- the server's memory ------------------------------------------------------------------------------------------
def num_threads(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration):
        return 0


def rss_parts(pid: int) -> dict[str, int]:
    """RssAnon / RssFile / RssShmem of /proc/PID/status in bytes (empty where there is no /proc): heap and other
    anonymous memory vs pages of mapped files (shared libraries paged in as new code paths run)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                    key, value = line.split()[:2]
                    out[key.rstrip(":")] = int(value) * 1024
    except OSError:
        pass
    return out


def rss_bytes(pid: int) -> int:
    """Resident set size of process pid (psutil if installed, else /proc/PID/status)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        pass
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope_mb_per_min(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS (MB) over time (minutes) of (seconds, bytes) points."""
    if len(points) < 2:
        return 0.0
    xs = [t / 60 for t, _ in points]
    ys = [b / MB for _, b in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


# ---- traffic -----------------------------------------------------------------------------------------------------
def picture(seed: int, size: tuple[int, int]) -> bytes:
    """A PNG of `size` whose content depends on seed only: a gradient and a few rectangles (fast, compresses well)."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    w, h = size
    c0, c1 = (
        np.array([rng.randrange(256) for _ in range(3)]),
        np.array([rng.randrange(256) for _ in range(3)]),
    )
    t = (
        np.linspace(0, 1, w)[None, :, None]
        if rng.random() < 0.5
        else np.linspace(0, 1, h)[:, None, None]
    )
    arr = np.broadcast_to(c0 + (c1 - c0) * t, (h, w, 3)).astype(np.uint8)
    img = Image.fromarray(np.ascontiguousarray(arr))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 5)):
        x0, x1 = sorted(rng.randrange(w) for _ in range(2))
        y0, y1 = sorted(rng.randrange(h) for _ in range(2))
        draw.rectangle((x0, y0, x1 + 1, y1 + 1), fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@dataclass
class Traffic:
    """What each request sends: new pictures of new sizes, exact repeats, new questions on recent pictures."""

    seed: int = 0
    max_side: int = 512
    recent: list[tuple[str, str]] = field(
        default_factory=list
    )  # (data URI, question) of recent requests
    pictures: int = 0  # distinct pictures made
    sizes: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def question(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(2, 12))) + "?"

    def next(self) -> tuple[list[str], str, int]:
        """(image data URIs, question, max tokens) of the next request."""
        with self.lock:
            roll = self.rng.random()
            if (
                roll < 0.15 and self.recent
            ):  # an exact repeat: processed-input cache, prefix and prompt-end hits
                uri, q = self.rng.choice(self.recent[-64:])
                return [uri], q, 8
            if roll < 0.3 and self.recent:  # a new question about a recent picture
                uri, _ = self.rng.choice(self.recent[-32:])
                images = [uri]
            else:  # new pictures, each of a new size when possible
                images = [self._new_picture() for _ in range(2 if roll > 0.9 else 1)]
            q, max_tokens = self.question(), self.rng.randint(1, 16)
            if len(images) == 1:
                self.recent.append((images[0], q))
                del self.recent[:-256]
            return images, q, max_tokens

    def _new_picture(self) -> str:
        self.pictures += 1
        size = (self.rng.randint(8, self.max_side), self.rng.randint(8, self.max_side))
        self.sizes.add(size)
        return data_uri(picture(self.seed * 1_000_003 + self.pictures, size))


def one_request(client, url: str, model: str, traffic: Traffic, rng: random.Random) -> str:
    """Send one request over a randomly chosen API; returns its kind ('' when it failed, with the error printed)."""
    images, question, max_tokens = traffic.next()
    kind = rng.choice(("triton", "triton_stream", "openai", "openai_stream"))
    try:
        if kind.startswith("triton"):
            tags = "".join("<image>\n" for _ in images)
            body = {
                "text_input": f"USER: {tags}{question} ASSISTANT:",
                "max_tokens": max_tokens,
                "temperature": rng.choice((0, 0.7)),
                "image_url_input": images if len(images) > 1 else images[0],
            }
            if kind == "triton_stream":
                body["stream"] = True
                r = client.post(f"{url}/v2/models/{model}/generate_stream", json=body)
                events = [
                    json.loads(e[len("data: ") :])
                    for e in r.text.split("\n\n")
                    if e.startswith("data: ")
                ]
                ok = r.status_code == 200 and bool(events) and not any("error" in e for e in events)
            else:
                r = client.post(f"{url}/v2/models/{model}/generate", json=body)
                ok = r.status_code == 200 and "text_output" in r.json()
        else:
            parts = [{"type": "image_url", "image_url": {"url": u}} for u in images]
            body = {
                "model": "ensemble",
                "max_tokens": max_tokens,
                "temperature": rng.choice((0, 0.7)),
                "messages": [
                    {"role": "user", "content": [*parts, {"type": "text", "text": question}]}
                ],
            }
            if kind == "openai_stream":
                body["stream"] = True
                r = client.post(f"{url}/v1/chat/completions", json=body)
                ok = r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            else:
                r = client.post(f"{url}/v1/chat/completions", json=body)
                ok = (
                    r.status_code == 200
                    and r.json()["choices"][0]["message"]["content"] is not None
                )
        if not ok:
            print(f"  {kind} failed: HTTP {r.status_code} {r.text[:300]}", flush=True)
            return ""
        return kind
    except Exception as exc:  # noqa: BLE001 - a soak counts failures, it does not stop on the first
        print(f"  {kind} failed: {exc!r}", flush=True)
        return ""


# ---- the server --------------------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    model = args.model
    if model is None:
        from mmserve.testing import default_model_dir

        model = str(default_model_dir())
    serve = [
        model,
        "--host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--grpc-port",
        "-1",
        "--device",
        args.device,
        "--log-level",
        "info",
        *args.server_arg,
    ]
    if args.encoder_cache_size is not None:
        serve += ["--encoder-cache-size", str(args.encoder_cache_size)]
    if args.kv_cache_size_gb is not None:
        serve += ["--kv-cache-size-gb", str(args.kv_cache_size_gb)]
    if args.tracemalloc:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", args.tracemalloc, *serve]
    elif args.trim_probe:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(log_path.parent), *serve]
    else:
        cmd = [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", *serve]
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.update(kv.split("=", 1) for kv in args.server_env)
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.start_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
            )
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            stop_server(proc)
            raise RuntimeError(
                f"server not ready after {args.start_timeout}s:\n{log_path.read_text()[-4000:]}"
            )
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def child(out_dir: str, serve_args: list[str]) -> int:
    """`mmserve serve` with tracemalloc on demand: the first SIGUSR1 starts tracing (tracing the startup would take
    minutes), the second writes what is still alive of the allocations made since, by line, to out_dir/growth.txt."""
    import tracemalloc

    def on_signal(signum, frame) -> None:
        if not tracemalloc.is_tracing():
            tracemalloc.start(8)
            (Path(out_dir) / "started").touch()
            return
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        lines = [
            f"alive now of what was allocated since tracing started: "
            f"{sum(s.size for s in snap.statistics('filename')) / MB:.2f} MB"
        ]
        lines += [str(s) for s in snap.statistics("lineno")[:25]]
        lines.append("\nthe 5 largest by traceback:")
        for stat in snap.statistics("traceback")[:5]:
            lines.append(f"{stat.size / 1024:.1f} KiB in {stat.count} blocks")
            lines += ["    " + line for line in stat.traceback.format()]
        tmp = Path(out_dir) / "growth.txt.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, Path(out_dir) / "growth.txt")

    trims = [0]

    def trim(
        signum, frame
    ) -> None:  # glibc only: give free heap pages back; how much came back tells
        import ctypes  # retained-but-free memory (fragmentation) from live objects

        try:
            ctypes.CDLL(None).malloc_trim(0)
        except AttributeError:  # not glibc: nothing to trim, the values before and after are equal
            pass
        (Path(out_dir) / f"trimmed-{trims[0]}").touch()
        trims[0] += 1

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGUSR2, trim)
    from mmserve.entrypoints.cli import main

    return main(["serve", *serve_args])


def signal_and_wait(
    proc: subprocess.Popen, path: Path, timeout: float = 300.0, signum=signal.SIGUSR1
) -> None:
    """A signal to the `--child` server (SIGUSR1: tracemalloc, SIGUSR2: malloc_trim), then wait for the file it
    writes."""
    os.kill(proc.pid, signum)
    deadline = time.time() + timeout
    while not path.exists():
        if time.time() > deadline:
            raise RuntimeError(f"the traced server wrote no {path} in {timeout}s")
        time.sleep(0.5)


def trim_server(proc: subprocess.Popen, out_dir: Path, index: int) -> tuple[int, int]:
    """malloc_trim(0) in the `--child` server (its index-th): its RSS before and after."""
    before = rss_bytes(proc.pid)
    signal_and_wait(proc, out_dir / f"trimmed-{index}", signum=signal.SIGUSR2)
    time.sleep(0.5)
    return before, rss_bytes(proc.pid)


# ---- the soak ----------------------------------------------------------------------------------------------------
def soak(args) -> dict:
    import httpx

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="soak-rss-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.tracemalloc:
        Path(args.tracemalloc).mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "server.log"
    proc, url = start_server(args, log_path)
    traffic = Traffic(seed=args.seed, max_side=args.max_side)
    samples: list[tuple[float, int, int]] = []  # (seconds since start, RSS bytes, requests done)
    anon_file: list[tuple[float, int, int]] = []  # (seconds since start, RssAnon, RssFile)
    done = {"ok": 0, "failed": 0}
    counts: dict[str, int] = {}
    stop = threading.Event()
    start = time.time()
    end = start + args.minutes * 60
    warm_at = start + args.minutes * 60 * args.warmup_fraction
    lock = threading.Lock()

    def worker(i: int) -> None:
        rng = random.Random(args.seed * 7919 + i)
        with httpx.Client(timeout=args.request_timeout) as client:
            while not stop.is_set() and time.time() < end:
                with lock:
                    if done["ok"] + done["failed"] >= args.max_requests:
                        return
                kind = one_request(client, url, args.model_name, traffic, rng)
                with lock:
                    done["ok" if kind else "failed"] += 1
                    counts[kind or "failed"] = counts.get(kind or "failed", 0) + 1

    growth, trims = None, []  # trims: (seconds, RSS before, RSS after) of each malloc_trim
    trim_dir = Path(args.tracemalloc or log_dir)
    try:
        threads = [
            threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)
        ]
        for t in threads:
            t.start()
        tracing = False
        print(
            f"server pid {proc.pid} at {url}, log {log_path}; {args.minutes} min, warm-up "
            f"{args.minutes * args.warmup_fraction:.1f} min",
            flush=True,
        )
        print(
            f"{'t_s':>7} {'rss_MB':>9} {'anon_MB':>8} {'file_MB':>8} {'requests':>9} {'pictures':>9} {'sizes':>7} "
            f"{'threads':>7}",
            flush=True,
        )
        while time.time() < end and any(t.is_alive() for t in threads):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server died with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            now = time.time()
            if (
                args.trim_probe and not trims and now >= warm_at
            ):  # the judged part starts without allocator slack
                trims.append((now - start, *trim_server(proc, trim_dir, 0)))
            rss, parts = rss_bytes(proc.pid), rss_parts(proc.pid)
            with lock:
                n = done["ok"] + done["failed"]
            samples.append((now - start, rss, n))
            anon_file.append((now - start, parts.get("RssAnon", 0), parts.get("RssFile", 0)))
            print(
                f"{now - start:7.1f} {rss / MB:9.1f} {parts.get('RssAnon', 0) / MB:8.1f} "
                f"{parts.get('RssFile', 0) / MB:8.1f} {n:9d} {traffic.pictures:9d} {len(traffic.sizes):7d} "
                f"{num_threads(proc.pid):7d}",
                flush=True,
            )
            if args.tracemalloc and not tracing and now >= warm_at:
                signal_and_wait(proc, Path(args.tracemalloc) / "started")
                tracing = True
            stop.wait(max(0.0, min(args.sample_s, end - time.time())))
        stop.set()
        for t in threads:
            t.join(timeout=args.request_timeout + 5)
        samples.append((time.time() - start, rss_bytes(proc.pid), done["ok"] + done["failed"]))
        if args.tracemalloc and tracing:
            signal_and_wait(proc, Path(args.tracemalloc) / "growth.txt")
            growth = (Path(args.tracemalloc) / "growth.txt").read_text()
        if args.trim_probe:
            trims.append((time.time() - start, *trim_server(proc, trim_dir, len(trims))))
    finally:
        stop.set()
        stop_server(proc)
    startup = [
        line for line in log_path.read_text(errors="replace").splitlines() if "caches:" in line
    ]
    after = [(t, b) for t, b, _ in samples if t >= (warm_at - start)]
    requests_after = [n for t, _, n in samples if t >= (warm_at - start)]
    parts_after = [p for p in anon_file if p[0] >= (warm_at - start)]
    result = {
        "minutes": args.minutes,
        "requests_ok": done["ok"],
        "requests_failed": done["failed"],
        "by_kind": counts,
        "distinct_pictures": traffic.pictures,
        "distinct_sizes": len(traffic.sizes),
        "rss_start_mb": round(samples[0][1] / MB, 1),
        "rss_end_mb": round(samples[-1][1] / MB, 1),
        "rss_max_mb": round(max(b for _, b, _ in samples) / MB, 1),
        "requests_after_warm": requests_after[-1] - requests_after[0] if requests_after else 0,
        "rss_at_warm_mb": round(after[0][1] / MB, 1) if after else None,
        "rss_after_warm_max_mb": round(max(b for _, b in after) / MB, 1) if after else None,
        "slope_all_mb_per_min": round(slope_mb_per_min([(t, b) for t, b, _ in samples]), 3),
        "slope_after_warm_mb_per_min": round(slope_mb_per_min(after), 3),
        # anonymous memory (heaps, tensors) vs file pages (shared libraries' code paged in on first use)
        "anon_slope_after_warm_mb_per_min": round(
            slope_mb_per_min([(t, a) for t, a, _ in parts_after]), 3
        ),
        "file_slope_after_warm_mb_per_min": round(
            slope_mb_per_min([(t, f) for t, _, f in parts_after]), 3
        ),
        # malloc_trim(0) at the end of warm-up and at the end (--trim-probe): what it gave back, and the growth of
        # what it could not (live memory) between the two
        "malloc_trim_released_mb": [round((b - a) / MB, 1) for _, b, a in trims],
        "live_growth_after_warm_mb": round((trims[-1][2] - trims[0][2]) / MB, 1)
        if len(trims) == 2
        else None,
        "live_slope_after_warm_mb_per_min": (
            round((trims[-1][2] - trims[0][2]) / MB / ((trims[-1][0] - trims[0][0]) / 60), 3)
            if len(trims) == 2
            else None
        ),
        "samples": [(round(t, 1), round(b / MB, 1), n) for t, b, n in samples],
        "server_caches_line": startup[-1] if startup else None,
    }
    if growth:
        result["python_alive_after_warm_mb"] = float(
            growth.splitlines()[0].rsplit(": ", 1)[1].split()[0]
        )
        result["tracemalloc_top"] = growth.splitlines()[1:12]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=5.0, help="length of the soak")
    p.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.5,
        help="the first part of the run that fills the caches; the slope is judged after it",
    )
    p.add_argument(
        "--max-slope-mb-per-min",
        type=float,
        default=1.0,
        help="exit 1 when the RSS left after malloc_trim (--no-trim-probe: RSS) grows faster than this "
        "after warm-up",
    )
    p.add_argument(
        "--model", default=None, help="checkpoint directory (default: the embedded demo model)"
    )
    p.add_argument(
        "--model-name", default="ensemble", help="Triton model the generate requests go to"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=4, help="client threads")
    p.add_argument(
        "--max-requests", type=int, default=1_000_000, help="stop after this many requests"
    )
    p.add_argument("--max-side", type=int, default=512, help="largest picture side in pixels")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument(
        "--encoder-cache-size",
        type=int,
        default=None,
        help="the server's encoder cache in rows (default: the server's); small fills it in a short run",
    )
    p.add_argument(
        "--kv-cache-size-gb",
        type=float,
        default=None,
        help="the server's CPU KV pool (default: the server's); small fills the prefix cache sooner",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="another `mmserve serve` flag (repeatable)",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of the server (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-dir", default=None, help="where the server's log goes (default: a temp dir)"
    )
    p.add_argument(
        "--tracemalloc",
        default=None,
        metavar="DIR",
        help="run the server under tracemalloc; write its top allocation growths after warm-up here",
    )
    p.add_argument(
        "--trim-probe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="(on by default) have the server call glibc's malloc_trim(0) at the end of warm-up and at the "
        "end: what that gives back is free memory the allocator kept, not live objects; the slope "
        "judged is the one of the RSS left after each",
    )
    p.add_argument("--json", default=None, help="also write the result as JSON to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(argv[1], argv[2:])
    args = parse_args(argv)
    result = soak(args)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if result["requests_failed"]:
        print(f"FAIL: {result['requests_failed']} requests failed")
        return 2
    slope, what = result["slope_after_warm_mb_per_min"], "RSS"
    if result["live_slope_after_warm_mb_per_min"] is not None:
        slope, what = result["live_slope_after_warm_mb_per_min"], "RSS after malloc_trim"
    if slope > args.max_slope_mb_per_min:
        print(
            f"FAIL: {what} grows {slope:.2f} MB/min after warm-up (limit {args.max_slope_mb_per_min})"
        )
        return 1
    print(f"OK: {what} slope after warm-up {slope:.2f} MB/min (limit {args.max_slope_mb_per_min})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
