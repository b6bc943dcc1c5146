"""Prometheus metrics of the server: request counts, latency histograms, token counters, engine gauges.

Every `mmserve_*` sample carries a `model_name` label (the served name), so replicas' metrics aggregate by model.
What sums over replicas is a counter: cache queries and hits (`mmserve_prefix_cache_queried_tokens` /
`_hit_tokens`, `mmserve_encoder_cache_queries` / `_hits`), `mmserve_preemptions`; the hit-rate gauges stay for
dashboards that read them. `mmserve_lora_requests_info` is the running / waiting LoRA adapters as labels (value: the
scrape time), as vLLM's `vllm:lora_requests_info` that the Kubernetes Gateway API Inference Extension reads."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mmserve.core.outputs import PHASES, PhaseTimes, RequestOutput
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
# 0.1 ms .. 10 s in 1-2-5 steps: a request's phases on the host take tenths of a millisecond
_PHASE_BUCKETS = tuple(m * 10.0**e for e in range(-4, 1) for m in (1, 2, 5)) + (10.0,)


class Metrics:
    """One registry per server (tests run several servers in one process)."""

    def __init__(self, stats_fn, step_stats_fn=None, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.requests = Counter(
            "mmserve_requests",
            "Requests by endpoint and HTTP/gRPC status",
            ["model_name", "endpoint", "status"],
            registry=r,
        )

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, m, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.ttft = histogram("mmserve_time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram(
            "mmserve_inter_token_latency_seconds", "Mean time between output tokens per request"
        )
        self.e2e = histogram("mmserve_e2e_request_latency_seconds", "Arrival to finish")
        phases = Histogram(
            "mmserve_request_phase_seconds",
            "A request's way to its first response bytes, by phase: receive (call start to the engine), media "
            "(picture fetch and decode), preprocess (processor, thread wait included), queue (engine thread to "
            "first scheduled), first_step (to the first token on the host), first_byte (to the first response "
            "bytes handed to the transport; the whole response when not streamed)",
            ["model_name", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.phases = {phase: phases.labels(model_name, phase) for phase in PHASES}
        self.prompt_tokens = Counter(
            "mmserve_prompt_tokens", "Prompt tokens of finished requests", m, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "mmserve_generation_tokens", "Generated tokens", m, registry=r
        ).labels(model_name)
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
            Gauge(name, doc, m, registry=r).labels(model_name).set_function(
                lambda key=key: float(self._stats_fn().get(key, 0.0))
            )
        r.register(_EngineCounters(stats_fn, model_name))
        if step_stats_fn is not None:
            r.register(_StepCollector(step_stats_fn))

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(
            model_name=self.model_name, endpoint=endpoint, status=str(status)
        ).inc()

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

    def observe_phases(self, times: PhaseTimes) -> None:
        """Record a request's phases, once it reached its first response bytes (nothing when a time is missing)."""
        durations = times.durations()
        for phase, seconds in (durations or {}).items():
            self.phases[phase].observe(seconds)

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


# stats() key -> (counter family, help): what sums over replicas
_COUNTERS = {
    "prefix_cache_queried_tokens": (
        "mmserve_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
    ),
    "prefix_cache_hit_tokens": (
        "mmserve_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache",
    ),
    "encoder_cache_queries": (
        "mmserve_encoder_cache_queries",
        "Pictures looked up in the encoder cache",
    ),
    "encoder_cache_hits": ("mmserve_encoder_cache_hits", "Pictures found in the encoder cache"),
    "num_preemptions": ("mmserve_preemptions", "Requests preempted (recomputed later)"),
}


class _EngineCounters:
    """The engine's cumulative cache and preemption counts as counters, and the LoRA info gauge."""

    def __init__(self, stats_fn, model_name: str) -> None:
        self.stats_fn, self.model_name = stats_fn, model_name

    def collect(self) -> Iterator[Metric]:
        s = self.stats_fn()
        for key, (name, doc) in _COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(s.get(key, 0)))
            yield family
        lora = GaugeMetricFamily(
            "mmserve_lora_requests_info",
            "LoRA adapters of running and waiting requests (value: the scrape's Unix time)",
            labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        labels = [
            self.model_name,
            str(s.get("running_lora_adapters", "")),
            str(s.get("waiting_lora_adapters", "")),
            str(int(s.get("max_loras", 0))),
        ]
        lora.add_metric(labels, time.time())
        yield lora
