"""Triton's and TensorRT-LLM's Prometheus metric families on mmserve's /metrics, so that dashboards and inference
gateways set up for Triton + TensorRT-LLM read mmserve unchanged: per model name the `nv_inference_*` request
counters and cumulative durations (from the statistics extension's numbers, statistics.py), and for the
`tensorrt_llm` model the engine gauges `nv_trt_llm_request_metrics{request_type}` (active, max, scheduled,
context, waiting) and `nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type}` (max, free, used, tokens_per,
fraction)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from mmserve.entrypoints.triton.models import MODEL_VERSION, TRTLLM
from mmserve.entrypoints.triton.statistics import TritonStatistics

# Triton family name -> (help, statistics phase, what of it: count, or microseconds of its ns)
_REQUEST_FAMILIES = {
    "nv_inference_request_success": (
        "Number of successful inference requests, all batch sizes",
        "success",
        "count",
    ),
    "nv_inference_request_failure": (
        "Number of failed inference requests, all batch sizes",
        "fail",
        "count",
    ),
    "nv_inference_request_duration_us": (
        "Cumulative inference request duration in microseconds",
        "success",
        "us",
    ),
    "nv_inference_queue_duration_us": (
        "Cumulative inference queuing duration in microseconds",
        "queue",
        "us",
    ),
    "nv_inference_compute_input_duration_us": (
        "Cumulative compute input duration in microseconds",
        "compute_input",
        "us",
    ),
    "nv_inference_compute_infer_duration_us": (
        "Cumulative compute inference duration in microseconds",
        "compute_infer",
        "us",
    ),
    "nv_inference_compute_output_duration_us": (
        "Cumulative inference compute output duration in microseconds",
        "compute_output",
        "us",
    ),
}


class TritonCollector:
    """A prometheus_client collector over the server's TritonStatistics and the engine's stats()."""

    def __init__(
        self, statistics: TritonStatistics, stats_fn: Callable[[], dict[str, float]]
    ) -> None:
        self.statistics = statistics
        self.stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        by_model = dict(self.statistics.by_model)
        for name, (doc, phase, what) in _REQUEST_FAMILIES.items():
            yield _counter(
                name,
                doc,
                {
                    model: s.phases[phase].count if what == "count" else s.phases[phase].ns / 1000
                    for model, s in by_model.items()
                },
            )
        yield _counter(
            "nv_inference_count",
            "Number of inferences performed (batch items)",
            {model: s.inference_count for model, s in by_model.items()},
        )
        yield _counter(
            "nv_inference_exec_count",
            "Number of model executions performed",
            {model: s.execution_count for model, s in by_model.items()},
        )
        yield from self._engine_gauges(self.stats_fn())

    @staticmethod
    def _engine_gauges(s: dict[str, float]):
        requests = GaugeMetricFamily(
            "nv_trt_llm_request_metrics",
            "TRT LLM request metrics",
            labels=["model", "request_type", "version"],
        )
        running, waiting = s.get("num_running", 0), s.get("num_waiting", 0)
        for kind, value in [
            ("active", running + waiting),
            ("max", s.get("max_num_seqs", 0)),
            ("scheduled", running),
            ("context", s.get("num_prefilling", 0)),
            ("waiting", waiting),
        ]:
            requests.add_metric([TRTLLM, kind, MODEL_VERSION], value)
        yield requests
        blocks = GaugeMetricFamily(
            "nv_trt_llm_kv_cache_block_metrics",
            "TRT LLM KV cache block metrics",
            labels=["kv_cache_block_type", "model", "version"],
        )
        total, usage = s.get("kv_cache_blocks_total", 0), s.get("kv_cache_usage", 0.0)
        used = round(total * usage)
        for kind, value in [
            ("max", total),
            ("free", total - used),
            ("used", used),
            ("tokens_per", s.get("block_size", 0)),
            ("fraction", usage),
        ]:
            blocks.add_metric([kind, TRTLLM, MODEL_VERSION], value)
        yield blocks


def _counter(name: str, doc: str, values: dict[str, float]) -> Metric:
    """A family of ever-growing values under Triton's exact sample names. Typed `untyped`: prometheus_client names a
    counter family `<name>_total` in its HELP/TYPE lines, which would not match Triton's `_total`-less samples;
    Prometheus's rate() works on either."""
    family = Metric(name, doc, "unknown")
    for model, value in values.items():
        family.add_sample(name, {"model": model, "version": MODEL_VERSION}, value)
    return family
