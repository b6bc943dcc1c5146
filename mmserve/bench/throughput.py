"""`mmserve bench throughput`: N requests (1 image + input_len text tokens, output_len tokens, ignore_eos; or a
`--dataset` file's) offline through `LLM.generate`; output tok/s, requests/s and goodput under `--goodput`
objectives, and the same requests through transformers in left-padded batches of `hf_batch_size`. Warm-up rounds
send the timed round's requests with fresh pictures of the same sizes, so every shape runs before the timing.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from tqdm import tqdm

from mmserve.bench.goodput import RequestTimes, goodput
from mmserve.bench.workload import (
    ModelSource,
    PromptTemplate,
    environment,
    free_device_memory,
    image_size_of,
    make_images,
    make_prompt,
    model_record,
    now,
    prompt_variants,
    sync,
)


@dataclass
class ThroughputConfig:
    """Settings of one offline throughput run."""

    source: ModelSource
    device: str
    dtype: str
    num_requests: int = 256
    input_len: int = 128  # text tokens per prompt (besides the image's placeholders)
    output_len: int = 128  # tokens generated per request (EOS ignored)
    warmup: int = 1  # untimed rounds of the timed requests (new pictures) first; at least 1
    iters: int = 1  # timed rounds, each with new images; the best (shortest) is reported
    baseline: str = "hf"  # hf | none
    hf_batch_size: int = 32  # transformers batch (static, left-padded)
    max_num_seqs: int = 64  # mmserve: requests running at once
    max_num_batched_tokens: int = 2048  # mmserve: token budget per step
    prefix_caching: bool = True  # mmserve default; distinct images give no hits
    same_image: bool = False  # one image for all requests, each with its own text (cache hits)
    kv_cache_memory_fraction: float = 0.9
    kv_cache_dtype: str = "auto"  # mmserve's KV storage: auto (the model's dtype) | fp8
    quantization: str | None = None  # mmserve's decoder weights: None (as in the checkpoint) | fp8
    tensor_parallel_size: int = 1  # mmserve's language model over this many GPUs
    enforce_eager: bool = False  # mmserve without CUDA graphs
    block_size: int = 16  # mmserve: tokens per KV cache block
    hf_attn: str | None = None
    image_size: int | None = (
        None  # side of the square images; None = the vision tower's input size, else 336
    )
    temperature: float = 0.0  # 0 = greedy (both engines); > 0 samples, with top_p / top_k
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    profile_dir: str | None = (
        None  # after the timed rounds, one more (new images) under the torch profiler
    )
    dataset: str | None = None  # a JSONL of requests (bench/dataset.py) instead of synthetic ones
    output_len_fixed: bool = True  # False: a dataset line's own output length wins over output_len
    goodput: dict[str, float] = field(default_factory=dict)  # SLO limits in ms: ttft / tpot / e2e

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.output_len < 1 or self.input_len < 0:
            raise ValueError("need num_requests >= 1, output_len >= 1, input_len >= 0")
        if self.warmup < 0 or self.iters < 1 or self.hf_batch_size < 1:
            raise ValueError("need warmup >= 0, iters >= 1, hf_batch_size >= 1")
        if self.baseline not in ("hf", "none"):
            raise ValueError(f"baseline must be hf or none, got {self.baseline!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        if self.dataset is not None and (self.baseline == "hf" or self.same_image):
            raise ValueError("--dataset runs mmserve only, with its own pictures: --baseline none")
        if (
            self.dataset is not None
        ):  # a malformed line or a missing picture: refused before any load
            from mmserve.bench.dataset import load_dataset

            load_dataset(self.dataset, self.num_requests, note=False)
        self.warmup = max(1, self.warmup)  # a shape's first run compiles kernels: never timed


@dataclass
class Workload:
    """The requests of a run: each one's full prompt and output length, and each round's pictures (warm-up
    rounds first, then timed rounds)."""

    texts: list[str]
    output_lens: list[int]
    warmup_rounds: list[list[list[Any]]]  # [round][request] -> pictures
    timed_rounds: list[list[list[Any]]]
    record: dict[str, Any] = field(default_factory=dict)


def _rates(
    num_requests: int, output_tokens: int, prompt_tokens: int, elapsed: float
) -> dict[str, float]:
    return {
        "elapsed_s": elapsed,
        "num_requests": num_requests,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "requests_per_s": num_requests / elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (output_tokens + prompt_tokens) / elapsed,
    }


def _image_rounds(
    cfg: ThroughputConfig, size: int, first: int = 0, count: int | None = None
) -> list[list[Any]]:
    """One list of request images per round (`count`, default the timed ones, from round number `first`), each
    drawn afresh: a round must not find the pictures of an earlier one in the prefix and encoder caches
    (same-image mode: one new picture per round, shared by that round's requests)."""
    rounds = range(first, first + (cfg.iters if count is None else count))
    seeds = [cfg.seed + r * 1_000_003 for r in rounds]
    if cfg.same_image:
        return [make_images(1, size, seed=seed) * cfg.num_requests for seed in seeds]
    return [make_images(cfg.num_requests, size, seed=seed) for seed in seeds]


def _request_times(outs: list[Any], start_wall: float) -> list[RequestTimes]:
    """Each request's latencies from its metrics, every request arriving at the round's start."""
    times = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        first, done = m.first_token_time - start_wall, m.finished_time - start_wall
        tpot = (done - first) * 1e3 / (n - 1) if n > 1 else None
        times.append(RequestTimes(ttft_ms=first * 1e3, e2e_ms=done * 1e3, tpot_ms=tpot))
    return times


def _run_mmserve(cfg: ThroughputConfig, model_dir: str, work: Workload) -> dict[str, Any]:
    from mmserve.llm import LLM
    from mmserve.sampling_params import SamplingParams

    llm = LLM(
        model_dir,
        dtype=cfg.dtype,
        device=cfg.device,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_prefix_caching=cfg.prefix_caching,
        kv_cache_memory_fraction=cfg.kv_cache_memory_fraction,
        kv_cache_dtype=cfg.kv_cache_dtype,
        quantization=cfg.quantization,
        seed=cfg.seed,
        block_size=cfg.block_size,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
    )
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            ignore_eos=True,
        )
        for n in work.output_lens
    ]

    def prompts(images: list[list[Any]]) -> list[dict[str, Any]]:
        return [{"prompt": t, "images": ims} for t, ims in zip(work.texts, images, strict=True)]

    try:
        for images in work.warmup_rounds:  # the timed requests' shapes, new pictures
            llm.generate(prompts(images), params, use_tqdm=False)
        best: dict[str, float] | None = None
        every_round: list[float] = []
        for images in work.timed_rounds:
            sync(cfg.device)
            llm.engine.step_stats.reset()
            start_wall, t0 = time.time(), now()
            outs = llm.generate(prompts(images), params)
            sync(cfg.device)
            elapsed = now() - t0
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            expected = sum(work.output_lens)
            if out_tokens != expected:
                raise RuntimeError(f"mmserve generated {out_tokens} tokens, expected {expected}")
            res = _rates(len(outs), out_tokens, sum(len(o.prompt_token_ids) for o in outs), elapsed)
            res["cached_prompt_tokens"] = sum(o.metrics.num_cached_tokens for o in outs)
            res["steps"] = llm.engine.step_stats.as_dict()
            res["goodput"] = goodput(_request_times(outs, start_wall), cfg.goodput, elapsed)
            every_round.append(res["output_tok_s"])
            if best is None or res["elapsed_s"] < best["elapsed_s"]:
                best = res
        assert best is not None
        best["output_tok_s_every_round"] = every_round
        if cfg.profile_dir:
            from mmserve.bench.kernel_profile import profiled

            (images,) = _fresh_pictures(work.timed_rounds[0], cfg.seed + 777_777, 1)
            with profiled(cfg.profile_dir):
                llm.generate(prompts(images), params, use_tqdm=False)
            best["profile"] = os.path.join(cfg.profile_dir, "kernels.md")
        return best
    finally:
        llm.close()
        del llm
        free_device_memory(cfg.device)


def _run_hf(cfg: ThroughputConfig, model_dir: str, work: Workload) -> dict[str, Any]:
    from mmserve.bench.hf_baseline import HFBaseline

    hf = HFBaseline(model_dir, cfg.device, cfg.dtype, cfg.hf_attn)
    bs, texts = cfg.hf_batch_size, work.texts
    try:
        for rounds in work.warmup_rounds:  # each batch size the timed round runs
            for size in sorted({len(texts[i : i + bs]) for i in range(0, len(texts), bs)}):
                hf.generate(texts[:size], [ims[0] for ims in rounds[:size]], 4)
        best: dict[str, Any] | None = None
        for requests in work.timed_rounds:
            images = [ims[0] for ims in requests]
            out_tokens = prompt_tokens = 0
            sync(cfg.device)
            t0 = now()
            for start in tqdm(
                range(0, len(images), bs),
                desc="transformers generate",
                total=math.ceil(len(images) / bs),
            ):
                batch = images[start : start + bs]
                timing = hf.generate(
                    texts[start : start + bs],
                    batch,
                    cfg.output_len,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                )
                out_tokens += timing.new_tokens * len(batch)
                prompt_tokens += timing.prompt_tokens * len(batch)
            elapsed = now() - t0
            res = {
                **_rates(len(images), out_tokens, prompt_tokens, elapsed),
                "batch_size": bs,
                "attn_implementation": hf.attn_implementation,
            }
            if best is None or res["elapsed_s"] < best["elapsed_s"]:
                best = res
        assert best is not None
        return best
    finally:
        hf.close()


def _fresh_pictures(model: list[list[Any]], seed: int, count: int) -> list[list[list[Any]]]:
    """`count` rounds of new noise pictures of the sizes of `model`'s, request by request."""
    return [
        [
            [
                make_images(1, im.width, seed=seed + r * 1_000_003 + i * 101 + k, height=im.height)[
                    0
                ]
                for k, im in enumerate(ims)
            ]
            for i, ims in enumerate(model)
        ]
        for r in range(count)
    ]


def _workload(cfg: ThroughputConfig, template: PromptTemplate, size: int) -> Workload:
    """Synthetic requests (new pictures every round), or the --dataset file's (its own pictures every timed
    round; the warm-up's are noise of their sizes)."""
    if cfg.dataset is None:
        spec = make_prompt(template, cfg.input_len)
        texts = (
            prompt_variants(template, spec, cfg.num_requests)
            if cfg.same_image
            else [spec.text] * cfg.num_requests
        )
        timed, warm = (
            [[[im] for im in images] for images in _image_rounds(cfg, size, first, count)]
            for first, count in ((0, cfg.iters), (cfg.iters, cfg.warmup))
        )
        record = {"text_tokens": spec.text_tokens, "distinct_texts": len(set(texts))}
        return Workload(texts, [cfg.output_len] * cfg.num_requests, warm, timed, record)
    from mmserve.bench.dataset import load_dataset, output_lens

    def count(text: str) -> int:
        return len(template.tokenizer(text, add_special_tokens=False).input_ids)

    lines = load_dataset(cfg.dataset, cfg.num_requests, count)
    pictures = [r.read_images() for r in lines]
    record = {
        "dataset": cfg.dataset,
        "distinct_lines": len({r.line for r in lines}),
        "cycled": len({r.line for r in lines}) < len(lines),
        "output_len_from": "--output-len" if cfg.output_len_fixed else "dataset",
    }
    return Workload(
        texts=[template.wrap(r.prompt, len(r.images)) for r in lines],
        output_lens=output_lens(
            lines, cfg.output_len if cfg.output_len_fixed else None, cfg.output_len
        ),
        warmup_rounds=_fresh_pictures(pictures, cfg.seed + 555_557, cfg.warmup),
        timed_rounds=[pictures] * cfg.iters,
        record=record,
    )


def run_throughput(cfg: ThroughputConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Run mmserve (and the baseline) over the same requests; return the result record."""
    model_dir = cfg.source.resolve()
    size = cfg.image_size or image_size_of(model_dir)
    work = _workload(cfg, PromptTemplate(model_dir), size)
    results: dict[str, Any] = {}
    errors: list[str] = []
    try:
        results["mmserve"] = _run_mmserve(cfg, model_dir, work)
    except Exception:
        errors.append("mmserve: " + traceback.format_exc())
    if cfg.baseline == "hf":
        try:
            results["hf"] = _run_hf(cfg, model_dir, work)
        except Exception:
            errors.append("hf: " + traceback.format_exc())
    if "mmserve" in results and "hf" in results:
        m, h = results["mmserve"], results["hf"]
        results["ratio"] = {
            "output_tok_s": m["output_tok_s"] / h["output_tok_s"],
            "requests_per_s": m["requests_per_s"] / h["requests_per_s"],
        }
    return {
        "schema": "mmserve-bench/1",
        "bench": "throughput",
        "env": environment(cfg.device, argv),
        "config": asdict(cfg),
        "model": {
            **model_record(cfg.source, model_dir),
            "dtype": cfg.dtype,
            "image_size": size,
            **work.record,
        },
        "results": results,
        "errors": errors,
    }
