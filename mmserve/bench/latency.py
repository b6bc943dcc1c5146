"""`mmserve bench latency`: a batch-size sweep of TTFT (1 image + N text tokens) and decode ms/step and tok/s,
for mmserve's Engine and the transformers baseline, next to the memory-bandwidth roofline of the same shapes.

mmserve: add B requests, step until each has its first token (TTFT), then time K decode-only engine steps
between device syncs: ms/step = elapsed / K, tok/s = B * 1000 / ms_per_step.
transformers: TTFT = generate(max_new_tokens=1); ms/step = (time of token K+1 - time of token 1) / K within one
generate(max_new_tokens=K+1), timestamped by a streamer (whose .cpu() of each token waits for the device).
"""

from __future__ import annotations

import dataclasses
import statistics
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from mmserve.bench.roofline import decode_roofline, lm_shape, measure_copy_bandwidth, shape_record
from mmserve.bench.workload import (
    ModelSource,
    PromptSpec,
    PromptTemplate,
    environment,
    free_device_memory,
    image_size_of,
    make_images,
    make_prompt,
    model_record,
    now,
    sync,
)


@dataclass
class LatencyConfig:
    """Settings of one latency sweep."""

    source: ModelSource
    device: str
    dtype: str
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    input_len: int = 128  # text tokens of each prompt (besides the image's placeholders)
    output_len: int = 32  # decode steps timed per trial (K)
    warmup: int = 1  # untimed trials per batch size, all before the first timed one (at least 1)
    iters: int = 3  # timed trials per batch size; medians are reported
    baseline: str = "hf"  # hf | none
    prefix_caching: bool = False  # off: every trial computes its prompt, as transformers does
    max_num_batched_tokens: int = 2048  # mmserve's token budget per step
    kv_cache_memory_fraction: float = 0.9
    kv_cache_dtype: str = "auto"  # mmserve's KV storage: auto (the model's dtype) | fp8
    quantization: str | None = (
        None  # mmserve's decoder weights: None (as in the checkpoint) | fp8 | int8 | int4
    )
    tensor_parallel_size: int = 1  # mmserve's language model over this many GPUs
    mm_encoder_tp_mode: str = "driver"  # mmserve's vision encoders under TP: driver | data
    images_per_request: int = 1  # pictures per prompt (more than 1: --baseline none)
    enforce_eager: bool = False  # mmserve without CUDA graphs
    block_size: int = 16  # mmserve: tokens per KV cache block
    bandwidth_mib: int | None = (
        None  # size of the copy that measures bandwidth; None = 1024 (cuda) / 64 (cpu)
    )
    hf_attn: str | None = None  # transformers attn_implementation; None = its default
    image_size: int | None = (
        None  # side of the square images; None = the vision tower's input size, else 336
    )
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.input_len < 0 or self.output_len < 1 or self.warmup < 0 or self.iters < 1:
            raise ValueError("need input_len >= 0, output_len >= 1, warmup >= 0, iters >= 1")
        if self.baseline not in ("hf", "none"):
            raise ValueError(f"baseline must be hf or none, got {self.baseline!r}")
        if self.images_per_request < 1:
            raise ValueError(f"images_per_request must be >= 1, got {self.images_per_request}")
        if self.images_per_request > 1 and self.baseline == "hf":
            raise ValueError("several images per request: mmserve only (--baseline none)")
        self.warmup = max(1, self.warmup)  # a shape's first run compiles kernels: never timed


def trial_order(cfg: LatencyConfig) -> list[tuple[int, int, bool]]:
    """(batch size, trial number, timed) in run order: every batch size's warm-up trials first, so each shape
    a timed trial runs (its prefill and decode steps, TTFT included) has run before any timing starts."""
    warm = [(b, t, False) for t in range(cfg.warmup) for b in cfg.batch_sizes]
    return warm + [(b, cfg.warmup + t, True) for b in cfg.batch_sizes for t in range(cfg.iters)]


def _trial_images(cfg: LatencyConfig, size: int, batch: int, trial: int) -> list[Any]:
    # Distinct per request and per trial: no encoder-cache or prefix-cache hits anywhere.
    return make_images(batch, size, seed=cfg.seed * 1_000_003 + batch * 1_000 + trial)


def _request_images(cfg: LatencyConfig, size: int, batch: int, trial: int) -> list[list[Any]]:
    """Each request's pictures (images_per_request each), all distinct."""
    n = cfg.images_per_request
    flat = make_images(batch * n, size, seed=cfg.seed * 1_000_003 + batch * 1_000 + trial)
    return [flat[i * n : (i + 1) * n] for i in range(batch)]


def multi_image_text(template: PromptTemplate, spec: PromptSpec, n: int) -> str:
    """`spec`'s prompt with n pictures instead of one."""
    return spec.text if n == 1 else template.wrap(spec.filler, n)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _mmserve_trial(
    engine: Any, spec: PromptSpec, images: list[list[Any]], steps: int, tag: str
) -> dict[str, float]:
    """One batch through the engine: TTFT of every request, then `steps` timed decode-only steps."""
    from mmserve.sampling_params import SamplingParams

    # Room to keep decoding: early requests decode while later ones still prefill (chunked prefill).
    params = SamplingParams(max_tokens=steps + 1024, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(images))]
    first: dict[str, float] = {}
    prompt_tokens = 0
    sync(engine.device.type)
    t0 = now()
    for rid, imgs in zip(ids, images, strict=True):
        engine.add_request(rid, {"prompt": spec.text, "images": imgs}, params)
    try:
        while len(first) < len(ids):
            if not engine.has_unfinished():
                raise RuntimeError("requests finished before all had a first token")
            outs = (
                engine.step()
            )  # its outputs are on the host: a token is there when step() returns
            t = now() - t0
            for o in outs:
                if o.request_id not in first:
                    first[o.request_id] = t
                    prompt_tokens = len(o.prompt_token_ids)
        sync(engine.device.type)
        t1 = now()
        for _ in range(steps):
            outs = engine.step()
            if len(outs) != len(ids) or any(o.finished for o in outs):
                raise RuntimeError(
                    f"step gave {len(outs)} outputs for {len(ids)} requests: not a pure decode step"
                )
        sync(engine.device.type)
        decode_s = (now() - t1) / steps
    finally:
        for rid in ids:
            engine.abort(rid)
    return {
        "ttft_s": max(first.values()),
        "ttft_mean_s": statistics.fmean(first.values()),
        "decode_s": decode_s,
        "prompt_tokens": prompt_tokens,
    }


def _device_memory(runner: Any, device: str) -> dict[str, float | None]:
    """GiB this rank holds: the model's weights as stored (quantized ones at their packed size), the KV pool,
    and the device's peak allocation over the run (CUDA only: weights, KV pool, activations, graphs)."""
    import torch

    gib = 2**30
    peak = None
    if torch.device(device).type == "cuda":
        peak = torch.cuda.max_memory_allocated(torch.device(device)) / gib
    return {
        "weights_gib": runner.weight_bytes() / gib,
        "kv_cache_gib": sum(c.numel() * c.element_size() for c in runner.kv_caches) / gib,
        "peak_allocated_gib": peak,
    }


def _run_mmserve(
    cfg: LatencyConfig, model_dir: str, spec: PromptSpec, size: int, memory: dict[str, Any]
) -> dict[int, list[dict]]:
    from mmserve.llm import LLM

    llm = LLM(
        model_dir,
        dtype=cfg.dtype,
        device=cfg.device,
        max_num_seqs=max(cfg.batch_sizes),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_caching=cfg.prefix_caching,
        kv_cache_memory_fraction=cfg.kv_cache_memory_fraction,
        kv_cache_dtype=cfg.kv_cache_dtype,
        quantization=cfg.quantization,
        seed=cfg.seed,
        block_size=cfg.block_size,
        tensor_parallel_size=cfg.tensor_parallel_size,
        mm_encoder_tp_mode=cfg.mm_encoder_tp_mode,
        enforce_eager=cfg.enforce_eager,
    )
    samples: dict[int, list[dict]] = {b: [] for b in cfg.batch_sizes}
    try:
        for b, trial, timed in tqdm(trial_order(cfg), desc="mmserve latency"):
            res = _mmserve_trial(
                llm.engine,
                spec,
                _request_images(cfg, size, b, trial),
                cfg.output_len,
                f"{'timed' if timed else 'warmup'}-b{b}t{trial}",
            )
            if timed:
                samples[b].append(res)
        memory.update(_device_memory(llm.engine.runner, cfg.device))
    finally:
        llm.close()
        del llm
        free_device_memory(cfg.device)
    return samples


def _run_hf(
    cfg: LatencyConfig, model_dir: str, spec: PromptSpec, size: int
) -> tuple[dict[int, list[dict]], str | None]:
    from mmserve.bench.hf_baseline import HFBaseline

    hf = HFBaseline(model_dir, cfg.device, cfg.dtype, cfg.hf_attn)
    samples: dict[int, list[dict]] = {b: [] for b in cfg.batch_sizes}
    try:
        for b, trial, timed in tqdm(trial_order(cfg), desc="transformers latency"):
            images = _trial_images(cfg, size, b, trial)
            prompts = [spec.text] * b
            one = hf.generate(prompts, images, 1)  # TTFT: its own call, warmed up as the other
            full = hf.generate(prompts, images, cfg.output_len + 1, stream=True)
            # K decode steps lie between the first and the last token of one call.
            decode_s = (full.token_times_s[-1] - full.token_times_s[0]) / cfg.output_len
            if timed:
                samples[b].append(
                    {
                        "ttft_s": one.total_s,
                        "ttft_mean_s": one.total_s,
                        "decode_s": decode_s,
                        "prompt_tokens": one.prompt_tokens,
                    }
                )
        return samples, hf.attn_implementation
    finally:
        hf.close()


def _summary(samples: list[dict], batch: int) -> dict[str, Any]:
    ms = [s["decode_s"] * 1e3 for s in samples]
    decode_ms = _median(ms)
    return {
        "ttft_ms": _median([s["ttft_s"] * 1e3 for s in samples]),
        "ttft_mean_ms": _median([s["ttft_mean_s"] * 1e3 for s in samples]),
        "decode_ms_per_step": decode_ms,
        "decode_tok_s": batch * 1e3 / decode_ms,
        "prompt_tokens": samples[0]["prompt_tokens"],
        "samples": {"ttft_ms": [s["ttft_s"] * 1e3 for s in samples], "decode_ms_per_step": ms},
    }


def run_latency(cfg: LatencyConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep and return the result record (see docs/benchmarks.md for its keys)."""
    model_dir = cfg.source.resolve()
    errors: list[str] = []
    mib = cfg.bandwidth_mib or (1024 if cfg.device.startswith("cuda") else 64)
    bandwidth = measure_copy_bandwidth(cfg.device, mib * 2**20)
    free_device_memory(cfg.device)  # the probe's buffers must not shrink mmserve's KV pool
    shape = lm_shape(
        model_dir, cfg.dtype, cfg.kv_cache_dtype, cfg.quantization, cfg.tensor_parallel_size
    )
    template = PromptTemplate(model_dir)
    spec = make_prompt(template, cfg.input_len)
    spec = dataclasses.replace(spec, text=multi_image_text(template, spec, cfg.images_per_request))
    size = cfg.image_size or image_size_of(model_dir)
    runs: dict[str, dict[int, list[dict]]] = {}
    memory: dict[str, Any] = {}  # mmserve's, on its first rank
    hf_attn = None
    try:
        runs["mmserve"] = _run_mmserve(cfg, model_dir, spec, size, memory)
    except Exception:  # keep going: the baseline's numbers are still worth having
        errors.append("mmserve: " + traceback.format_exc())
    if cfg.baseline == "hf":
        try:
            runs["hf"], hf_attn = _run_hf(cfg, model_dir, spec, size)
        except Exception:
            errors.append("hf: " + traceback.format_exc())
    results = []
    for b in cfg.batch_sizes:
        row: dict[str, Any] = {"batch_size": b}
        for name, samples in runs.items():
            row[name] = _summary(samples[b], b) if samples.get(b) else None
        prompt_tokens = next(
            (row[n]["prompt_tokens"] for n in runs if row.get(n)), spec.text_tokens
        )
        context = (
            prompt_tokens + 1 + cfg.output_len / 2
        )  # mean KV length over the timed decode steps
        row["roofline"] = decode_roofline(shape, b, context, bandwidth["bytes_per_s"])
        if row.get("mmserve") and row.get("hf"):
            row["ratio"] = {
                "ttft": row["mmserve"]["ttft_ms"] / row["hf"]["ttft_ms"],
                "decode_tok_s": row["mmserve"]["decode_tok_s"] / row["hf"]["decode_tok_s"],
            }
        for name in runs:
            if row.get(name):
                row[name]["roofline_fraction"] = (
                    row["roofline"]["ms_per_step"] / row[name]["decode_ms_per_step"]
                )
        results.append(row)
    config = asdict(cfg)
    config["hf_attn_used"] = hf_attn
    return {
        "schema": "mmserve-bench/1",
        "bench": "latency",
        "env": environment(cfg.device, argv),
        "config": config,
        "model": {
            **model_record(cfg.source, model_dir),
            "dtype": cfg.dtype,
            "image_size": size,
            "text_tokens": spec.text_tokens,
            "lm": shape_record(shape),
        },
        "bandwidth": bandwidth,
        "memory": memory or None,
        "results": results,
        "errors": errors,
    }
