"""Prometheus metrics of the server: request counts, latency histograms, token counters, engine gauges."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from mmserve.core.outputs import RequestOutput
from mmserve.core.step import STEP_KINDS

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    60.0,
)


class Metrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, stats_fn, step_stats_fn=None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mmserve_requests",
            "Requests by endpoint and HTTP/gRPC status",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "mmserve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mmserve_inter_token_latency_seconds",
            "Mean time between output tokens per request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "mmserve_e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "mmserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.generation_tokens = Counter(
            "mmserve_generation_tokens", "Generated tokens", registry=r
        )
        self._stats_fn = stats_fn
        gauges = {
            "num_running": ("mmserve_num_requests_running", "Requests in the running batch"),
            "num_waiting": ("mmserve_num_requests_waiting", "Requests waiting to be scheduled"),
            "kv_cache_usage": (
                "mmserve_kv_cache_usage_ratio",
                "Fraction of KV blocks held by requests",
            ),
            "kv_cache_blocks_total": ("mmserve_kv_cache_blocks_total", "KV blocks in the pool"),
            "kv_cache_bytes_per_token": (
                "mmserve_kv_cache_bytes_per_token",
                "KV cache bytes per token over all layers (halved by --kv-cache-dtype fp8)",
            ),
            "prefix_cache_hit_rate": (
                "mmserve_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache",
            ),
            "encoder_cache_hit_rate": (
                "mmserve_encoder_cache_hit_rate",
                "Vision encodings served from the cache",
            ),
            "prompt_end_cache_hits": (
                "mmserve_prompt_end_cache_hits",
                "First tokens sampled from a repeated prompt's kept final hidden state",
            ),
            "num_preemptions": ("mmserve_num_preemptions", "Requests preempted so far"),
            "cross_kv_cache_usage": (
                "mmserve_cross_kv_cache_usage_ratio",
                "Fraction of the cross-attention pool's blocks held by requests (0 without one)",
            ),
            "cross_kv_cache_blocks_total": (
                "mmserve_cross_kv_cache_blocks_total",
                "Blocks of the cross-attention pool (cross-attention models only)",
            ),
        }
        for key, (name, doc) in gauges.items():
            Gauge(name, doc, registry=r).set_function(
                lambda key=key: float(self._stats_fn().get(key, 0.0))
            )
        if step_stats_fn is not None:
            r.register(_StepCollector(step_stats_fn))

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def on_finished(self, out: RequestOutput) -> None:
        """Record latency and token counts of a finished request."""
        m = out.metrics
        n_out = len(out.outputs[0].token_ids) if out.outputs else 0
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(n_out)
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.finished_time is not None and n_out > 1:
                self.itl.observe((m.finished_time - m.first_token_time) / (n_out - 1))
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StepCollector:
    """Engine steps by kind, from Engine.step_stats: how many, their tokens, and the time Engine.step() spent
    on the host vs blocked on the device (a server whose host share grows is bound by Python, not the GPU)."""

    def __init__(self, step_stats_fn) -> None:
        self._fn = step_stats_fn

    def collect(self) -> Iterator[Metric]:
        stats = self._fn()
        steps = CounterMetricFamily(
            "mmserve_engine_steps",
            "Engine steps launched, by kind (decode, prefill, mixed)",
            labels=["kind"],
        )
        tokens = CounterMetricFamily(
            "mmserve_engine_step_tokens",
            "Tokens computed by engine steps, by kind",
            labels=["kind"],
        )
        seconds = CounterMetricFamily(
            "mmserve_engine_step_seconds",
            "Time in Engine.step() by step kind and part: host (scheduling, inputs, "
            "launches, outputs) or device_wait (blocked on the step's sampled tokens)",
            labels=["kind", "part"],
        )
        for kind in STEP_KINDS:
            t = stats[kind]
            steps.add_metric([kind], t["steps"])
            tokens.add_metric([kind], t["tokens"])
            seconds.add_metric([kind, "host"], t["host_s"])
            seconds.add_metric([kind, "device_wait"], t["device_wait_s"])
        yield from (steps, tokens, seconds)
