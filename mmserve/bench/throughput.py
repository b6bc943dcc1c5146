"""`mmserve bench throughput`: N requests (1 image + input_len text tokens, output_len tokens, ignore_eos)
offline through `LLM.generate`; output tok/s and requests/s, and the same requests through transformers
in left-padded batches of `hf_batch_size`.
"""

from __future__ import annotations

import math
import os
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

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
    warmup: int = 1  # untimed warmup rounds (a few short requests each)
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

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.output_len < 1 or self.input_len < 0:
            raise ValueError("need num_requests >= 1, output_len >= 1, input_len >= 0")
        if self.warmup < 0 or self.iters < 1 or self.hf_batch_size < 1:
            raise ValueError("need warmup >= 0, iters >= 1, hf_batch_size >= 1")
        if self.baseline not in ("hf", "none"):
            raise ValueError(f"baseline must be hf or none, got {self.baseline!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")


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


def _image_rounds(cfg: ThroughputConfig, size: int) -> list[list[Any]]:
    """One list of request images per timed round, each drawn afresh: a round must not find the pictures of an
    earlier one in the prefix and encoder caches (same-image mode: one new picture per round, shared by that
    round's requests)."""
    seeds = [cfg.seed + r * 1_000_003 for r in range(cfg.iters)]
    if cfg.same_image:
        return [make_images(1, size, seed=seed) * cfg.num_requests for seed in seeds]
    return [make_images(cfg.num_requests, size, seed=seed) for seed in seeds]


def _run_mmserve(
    cfg: ThroughputConfig, model_dir: str, texts: list[str], rounds: list[list[Any]]
) -> dict[str, Any]:
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
    params = SamplingParams(
        max_tokens=cfg.output_len,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        ignore_eos=True,
    )
    try:
        for w in range(cfg.warmup):
            warm = make_images(min(4, cfg.num_requests), rounds[0][0].width, seed=10_000 + w)
            llm.generate(
                [{"prompt": texts[0], "images": [im]} for im in warm],
                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )
        best: dict[str, float] | None = None
        every_round: list[float] = []
        for images in rounds:
            prompts = [{"prompt": text, "images": [im]} for text, im in zip(texts, images)]
            sync(cfg.device)
            llm.engine.step_stats.reset()
            t0 = now()
            outs = llm.generate(prompts, params)
            sync(cfg.device)
            elapsed = now() - t0
            out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            expected = cfg.num_requests * cfg.output_len
            if out_tokens != expected:
                raise RuntimeError(f"mmserve generated {out_tokens} tokens, expected {expected}")
            res = _rates(len(outs), out_tokens, sum(len(o.prompt_token_ids) for o in outs), elapsed)
            res["cached_prompt_tokens"] = sum(o.metrics.num_cached_tokens for o in outs)
            res["steps"] = llm.engine.step_stats.as_dict()
            every_round.append(res["output_tok_s"])
            if best is None or res["elapsed_s"] < best["elapsed_s"]:
                best = res
        assert best is not None
        best["output_tok_s_every_round"] = every_round
        if cfg.profile_dir:
            from mmserve.bench.kernel_profile import profiled

            images = make_images(cfg.num_requests, rounds[0][0].width, seed=cfg.seed + 777_777)
            with profiled(cfg.profile_dir):
                llm.generate(
                    [{"prompt": text, "images": [im]} for text, im in zip(texts, images)],
                    params,
                    use_tqdm=False,
                )
            best["profile"] = os.path.join(cfg.profile_dir, "kernels.md")
        return best
    finally:
        llm.close()
        del llm
        free_device_memory(cfg.device)


def _run_hf(
    cfg: ThroughputConfig, model_dir: str, texts: list[str], rounds: list[list[Any]]
) -> dict[str, Any]:
    from mmserve.bench.hf_baseline import HFBaseline

    hf = HFBaseline(model_dir, cfg.device, cfg.dtype, cfg.hf_attn)
    bs = cfg.hf_batch_size
    try:
        for w in range(cfg.warmup):
            warm = make_images(min(bs, cfg.num_requests), rounds[0][0].width, seed=20_000 + w)
            hf.generate(texts[: len(warm)], warm, 4)
        best: dict[str, Any] | None = None
        for images in rounds:
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


def run_throughput(cfg: ThroughputConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Run mmserve (and the baseline) over the same requests; return the result record."""
    model_dir = cfg.source.resolve()
    spec = make_prompt(PromptTemplate(model_dir), cfg.input_len)
    size = cfg.image_size or image_size_of(model_dir)
    rounds = _image_rounds(cfg, size)
    if cfg.same_image:
        texts = prompt_variants(PromptTemplate(model_dir), spec, cfg.num_requests)
    else:
        texts = [spec.text] * cfg.num_requests
    results: dict[str, Any] = {}
    errors: list[str] = []
    try:
        results["mmserve"] = _run_mmserve(cfg, model_dir, texts, rounds)
    except Exception:
        errors.append("mmserve: " + traceback.format_exc())
    if cfg.baseline == "hf":
        try:
            results["hf"] = _run_hf(cfg, model_dir, texts, rounds)
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
            "text_tokens": spec.text_tokens,
            "distinct_texts": len(set(texts)),
        },
        "results": results,
        "errors": errors,
    }
