"""Each bench's warm-up runs every shape its timed part runs, before any timing: checked on what the engine (or
the server) was given, never on times."""

from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from mmserve.bench.cli import main
from mmserve.engine.scheduler import Scheduler
from mmserve.llm import LLM
from tests.conftest import strict_json


def test_latency_warms_every_batch_size_s_step_shapes_before_the_first_timed_trial(
    tiny_llava_dir, tmp_path, monkeypatch
):
    steps: list[tuple[str, tuple[str, int, int]]] = []  # (trial tag, (kind, tokens, sequences))
    schedule = Scheduler.schedule

    def recording(self):
        out = schedule(self)
        if not out.empty:
            tags = {s.request.request_id.rsplit("-", 1)[0] for s in out.scheduled}
            assert len(tags) == 1  # a step holds one trial's requests
            steps.append((tags.pop(), (out.kind, out.num_batched_tokens, len(out.scheduled))))
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    args = ["latency", "--model", tiny_llava_dir, "--device", "cpu", "--batch-sizes", "1,3"]
    args += ["--input-len", "8", "--output-len", "2", "--warmup", "0", "--iters", "2"]
    assert main([*args, "--baseline", "none", "--out", str(tmp_path / "r.json")]) == 0
    assert strict_json((tmp_path / "r.json").read_text())["config"]["warmup"] == 1
    first_timed = next(i for i, (tag, _) in enumerate(steps) if tag.startswith("timed"))
    warm, timed = steps[:first_timed], steps[first_timed:]
    assert warm and all(tag.startswith("warmup") for tag, _ in warm)
    assert all(tag.startswith("timed") for tag, _ in timed)  # no warm-up after timing began
    assert {shape for _, shape in timed} <= {shape for _, shape in warm}
    assert {shape[2] for _, shape in timed} == {1, 3}  # both batch sizes were timed


def test_throughput_warmup_sends_the_timed_requests_with_new_pictures(
    tiny_llava_dir, tmp_path, monkeypatch
):
    calls: list[tuple[list[str], list[tuple], list[int], list[bytes]]] = []
    generate = LLM.generate

    def recording(self, prompts, params=None, **kw):
        sizes = [tuple(im.size for im in p["images"]) for p in prompts]
        pixels = [im.tobytes() for p in prompts for im in p["images"]]
        tokens = [q.max_tokens for q in params] if isinstance(params, list) else [params.max_tokens]
        calls.append(([p["prompt"] for p in prompts], sizes, tokens, pixels))
        return generate(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", recording)
    args = ["throughput", "--model", tiny_llava_dir, "--device", "cpu", "--num-requests", "3"]
    args += ["--input-len", "10", "--output-len", "5", "--warmup", "0", "--baseline", "none"]
    assert main([*args, "--out", str(tmp_path / "r.json")]) == 0
    assert len(calls) == 2  # one warm-up round (--warmup 0 still warms), one timed
    (w_texts, w_sizes, w_tokens, w_pixels), (t_texts, t_sizes, t_tokens, t_pixels) = calls
    assert (w_texts, w_sizes) == (t_texts, t_sizes) and len(w_texts) == 3
    assert w_tokens == t_tokens and set(t_tokens) == {5}
    assert not set(w_pixels) & set(t_pixels)  # new pictures: no cache hits for the timed round


class _RecordingOpenAI(BaseHTTPRequestHandler):
    """An OpenAI-style server that streams `max_tokens` one-word chunks and records each chat request: its text,
    picture sizes, max_tokens and whether it streamed. Its first `burst.parties` requests answer only once that
    many are open at once (`together`: they were; a sequential client leaves the barrier to time out)."""

    lock = threading.Lock()
    seen: list[dict] = []
    burst = threading.Barrier(1)

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._json({"data": [{"id": "stub-model", "owned_by": "stubserve"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        parts = body["messages"][0]["content"]
        sizes = [
            Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))).size
            for p in parts
            if p["type"] == "image_url"
        ]
        cls = type(self)
        with cls.lock:
            record = {
                "text": parts[-1]["text"],
                "sizes": sizes,
                "max_tokens": body["max_tokens"],
                "stream": body["stream"],
            }
            cls.seen.append(record)
            first = len(cls.seen) <= cls.burst.parties
        if first:
            try:
                cls.burst.wait()
                record["together"] = True
            except threading.BrokenBarrierError:
                record["together"] = False
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"delta": {"content": "x "}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def stub_openai():
    _RecordingOpenAI.seen = []
    _RecordingOpenAI.burst = threading.Barrier(3, timeout=30)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", _RecordingOpenAI.seen
    finally:
        server.shutdown()
        server.server_close()


def _png(path: Path, size: tuple[int, int], seed: int) -> None:
    Image.effect_noise(size, 40 + seed).convert("RGB").save(path)


def test_serve_warmup_covers_each_request_shape_at_the_sweep_s_peak_concurrency(
    stub_openai, tmp_path
):
    url, seen = stub_openai
    _png(tmp_path / "wide.png", (48, 24), 1)
    _png(tmp_path / "tall.png", (20, 40), 2)
    lines = [
        {"prompt": "first", "images": ["wide.png"], "output_len": 3},
        {"prompt": "second", "images": ["tall.png", "wide.png"], "output_len": 2},
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = ["serve", "--url", url, "--protocol", "openai", "--dataset", str(tmp_path / "d.jsonl")]
    args += ["--request-rates", "", "--concurrency", "1,3", "--num-requests", "4", "--warmup", "1"]
    assert main([*args, "--out", str(tmp_path / "r.json")]) == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["labels"]["server"] == "stubserve"  # the models' owned_by
    n_warm = result["workload"]["warmup_requests"]
    assert n_warm == 3 and result["workload"]["warmup_concurrency"] == 3
    warm, timed = seen[:n_warm], seen[n_warm:]
    assert len(timed) == 8  # two points of 4
    shape = lambda r: (r["text"], tuple(r["sizes"]), r["max_tokens"], r["stream"])  # noqa: E731
    assert {shape(r) for r in timed} <= {shape(r) for r in warm}
    assert all(r["together"] for r in warm)  # the largest point's batch, before timing
