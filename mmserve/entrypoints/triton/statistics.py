"""Triton's statistics extension (`GET /v2/models[/<model>[/versions/<v>]]/stats`, gRPC `ModelStatistics`):
per served model name, counts and cumulative durations of its requests, which perf_analyzer and genai-perf read
around each measurement window.

What each duration measures here (Triton's names; every Triton request counts once per batch item):
- success / fail: from the request reaching the model (its inputs parsed) to its last response, for requests that
  ended normally / with an error or a client's disconnect;
- compute_input: from then until the engine took the request (the picture through the HF processor, tokenizing);
- queue: waiting in the engine's queue until its first step;
- compute_infer: its first step to its last token (prefill and decode, shared with the batch it ran in);
- compute_output: its last token to its last response (detokenizing, building the output tensors).
inference_count counts batch items, execution_count requests (mmserve batches inside the engine, not per model
execution); cache hits / misses stay 0 (Triton's response cache; prefix-cache hits are in /metrics)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from mmserve.core.outputs import RequestOutput

PHASES = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += max(0, int(seconds * 1e9))


@dataclass
class ModelStatistics:
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    phases: dict[str, Duration] = field(default_factory=lambda: {p: Duration() for p in PHASES})


class Execution:
    """One request's record while it runs (`TritonStatistics.execution`): `finished` notes each batch item's final
    engine output, whose timestamps give queue / compute times."""

    def __init__(self) -> None:
        self.start = time.time()
        self.outputs: list[RequestOutput] = []

    def finished(self, out: RequestOutput | None) -> None:
        if out is not None:
            self.outputs.append(out)


class TritonStatistics:
    def __init__(self) -> None:
        self.by_model: dict[str, ModelStatistics] = defaultdict(ModelStatistics)

    @contextlib.contextmanager
    def execution(self, model: str, batch_size: int) -> Iterator[Execution]:
        """Time one request of `batch_size` items to `model`; an exception or a close before the end is a fail."""
        ex, ok = Execution(), False
        try:
            yield ex
            ok = True
        finally:
            self._record(model, batch_size, ex, ok)

    def _record(self, model: str, batch_size: int, ex: Execution, ok: bool) -> None:
        end = time.time()
        stats = self.by_model[model]
        stats.last_inference_ms = int(end * 1000)
        stats.inference_count += batch_size
        stats.execution_count += 1
        phases = stats.phases
        for _ in range(batch_size):
            phases["success" if ok else "fail"].add(end - ex.start)
        for out in ex.outputs if ok else ():
            m = out.metrics
            if m is None or m.first_scheduled_time is None or m.finished_time is None:
                continue
            phases["compute_input"].add(m.arrival_time - ex.start)
            phases["queue"].add(m.first_scheduled_time - m.arrival_time)
            phases["compute_infer"].add(m.finished_time - m.first_scheduled_time)
            phases["compute_output"].add(end - m.finished_time)

    def as_json(self, models: list[str], version: str) -> dict:
        """The extension's JSON answer for these model names."""
        return {"model_stats": [self._json(name, version) for name in models]}

    def _json(self, name: str, version: str) -> dict:
        stats = self.by_model.get(name, ModelStatistics())
        return {
            "name": name,
            "version": version,
            "last_inference": stats.last_inference_ms,
            "inference_count": stats.inference_count,
            "execution_count": stats.execution_count,
            "inference_stats": {
                p: {f.name: getattr(d, f.name) for f in fields(d)} for p, d in stats.phases.items()
            },
            "batch_stats": [],
            "memory_usage": [],
        }
