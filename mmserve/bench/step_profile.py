"""`python -m mmserve.bench.step_profile`: where one decode step's time goes (GPU graph vs host work).

Prints wall ms/step, the CUDA-graph replay's GPU time alone, and the torch profiler's top kernels. With
programmatic dependent launch (kernels/pdl.py, on by default on Hopper) a kernel's time in those tables starts
when it is launched early and includes waiting for the kernel before it, so the times overlap; run with
MMSERVE_DISABLE_PDL=1 for per-kernel times that add up.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time

import torch

from mmserve.bench.workload import (
    ModelSource,
    PromptTemplate,
    image_size_of,
    make_images,
    make_prompt,
    prompt_variants,
)
from mmserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="mmserve.bench.step_profile")
    ap.add_argument("--model")
    ap.add_argument("--preset")
    ap.add_argument("--family", default=None, help="family of --preset (default llava)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument(
        "--prefill-batch",
        type=int,
        default=0,
        help="also profile the prefill of this many requests",
    )
    ap.add_argument(
        "--mixed-batch",
        type=int,
        default=0,
        help="also profile steps that mix this many decoding requests with new prompts' prefill",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES])
    ap.add_argument("--quantization", default=None, choices=list(QUANTIZATION_METHODS))
    args = ap.parse_args(argv)
    from mmserve import LLM, SamplingParams

    model_dir = ModelSource(model=args.model, preset=args.preset, family=args.family).resolve()
    # distinct images below: no prefix hits in decode
    # every profiled request decodes at once (the default max_num_seqs of 64 would leave a larger batch's
    # step without a decode graph bucket)
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device="cuda",
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(64, args.batch_size, args.prefill_batch, args.mixed_batch + 80),
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
    )
    engine = llm.engine
    template = PromptTemplate(model_dir)
    spec = make_prompt(template, 24)
    question = prompt_variants(template, spec, 2)[1]  # the same length, its last words differ
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for seed in (98, 99, 100):  # the first run warms up kernels; the third runs under the profiler
        _ttft_breakdown(
            engine, spec.text, make_images(1, image_size_of(model_dir), seed=seed)[0], seed == 100
        )
    for seed in (97, 95):  # the first pair warms up the 8-token prefill path
        _prefix_hit_ttft(
            engine, spec.text, question, make_images(1, image_size_of(model_dir), seed=seed)[0]
        )
    host = cProfile.Profile()  # where the host time of a miss and a hit goes (Python functions)
    with _profiling(host):
        _prefix_hit_ttft(
            engine, spec.text, question, make_images(1, image_size_of(model_dir), seed=94)[0]
        )
    print("host profile of the miss + hit above (cProfile inflates Python-heavy code):")
    pstats.Stats(host).sort_stats("tottime").print_stats(30)
    if args.prefill_batch:
        _prefill_profile(
            engine, spec.text, make_images(args.prefill_batch, image_size_of(model_dir), seed=96)
        )
    if args.mixed_batch:
        _mixed_profile(
            engine,
            spec.text,
            make_images(args.mixed_batch + 80, image_size_of(model_dir), seed=200),
            args.mixed_batch,
        )
    for i, img in enumerate(make_images(args.batch_size, image_size_of(model_dir))):
        engine.add_request(str(i), {"prompt": spec.text, "images": [img]}, params)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / args.steps * 1000

    graphs = engine.runner.graphs
    gpu = float("nan")
    if graphs is not None:
        b = min(x for x in graphs.buckets if x >= args.batch_size)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            graphs.graphs[b].replay()
        end.record()
        torch.cuda.synchronize()
        gpu = start.elapsed_time(end) / args.steps
    print(
        f"batch {args.batch_size}: wall {wall:.3f} ms/step, graph replay (GPU only) {gpu:.3f} ms/step, "
        f"host + sampling {wall - gpu:.3f} ms/step"
    )
    _print_kernel_choices()
    from mmserve.kernels.pdl import pdl_options

    if pdl_options(torch.device("cuda"))["PDL"]:
        print(
            "programmatic dependent launch is on: kernel times below overlap (MMSERVE_DISABLE_PDL=1 to separate)"
        )

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def _print_kernel_choices() -> None:
    """kernels/fastest.py's per-shape choices, with the times that made them (ms per candidate)."""
    from mmserve.kernels.fastest import TIMINGS

    for key, times in TIMINGS.items():
        best = min(range(len(times)), key=times.__getitem__)
        print(
            f"kernel choice {key}: candidate {best} of "
            + ", ".join(f"{t * 1000:.1f}" for t in times)
            + " us"
        )


def _ttft_breakdown(engine, prompt: str, image, profile: bool = False) -> None:
    """Split a single request's time to first token: preprocessing, vision encoder, prefill + sampling."""

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, (time.perf_counter() - t0) * 1000

    device, engine.inputs.device = engine.inputs.device, None
    _, t_pre_cpu = timed(lambda: engine.inputs.process({"prompt": prompt, "images": [image]}))
    engine.inputs.device = device
    engine.inputs.clear_recent()  # else the second call is an exact repeat and skips the HF processor
    inputs, t_pre = timed(lambda: engine.preprocess({"prompt": prompt, "images": [image]}))
    moved = engine.runner.encoder.encode  # the runner's own encoder path, timed
    _, t_enc = timed(lambda: moved(inputs.mm_items))
    engine.runner.encoder.cache.clear()
    from mmserve import SamplingParams

    engine.add_processed("ttft", inputs, SamplingParams(max_tokens=1, temperature=0.0))
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, t_first = timed(lambda: [engine.step() for _ in range(8) if engine.has_unfinished()])
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    else:
        _, t_first = timed(lambda: [engine.step() for _ in range(8) if engine.has_unfinished()])
    print(
        f"TTFT breakdown (1 image + {len(inputs.prompt_token_ids)} tokens): preprocess {t_pre:.2f} ms ({t_pre_cpu:.2f} ms on CPU), "
        f"vision encoder alone {t_enc:.2f} ms, engine steps to first token (encoder + prefill + sample) "
        f"{t_first:.2f} ms"
    )


def _prefill_profile(engine, prompt: str, images: list) -> None:
    """Preprocess a batch of requests, then profile the engine steps until each has its first token."""
    from torch.profiler import ProfilerActivity, profile

    from mmserve import SamplingParams

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    inputs = [engine.preprocess({"prompt": prompt, "images": [im]}) for im in images]
    torch.cuda.synchronize()
    t_pre = (time.perf_counter() - t0) * 1000
    for i, inp in enumerate(inputs):
        engine.add_processed(f"prefill-{i}", inp, SamplingParams(max_tokens=1, temperature=0.0))
    tokens = sum(len(inp.prompt_token_ids) for inp in inputs)
    steps = 0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1000
    print(
        f"prefill of {len(images)} requests ({tokens} tokens): preprocess {t_pre:.1f} ms (serial), "
        f"{steps} engine steps {wall:.1f} ms under the profiler = {tokens / wall * 1000:.0f} tok/s"
    )
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


def _mixed_profile(engine, prompt: str, images: list, num_decoding: int) -> None:
    """num_decoding requests decode while new prompts prefill beside them (the steady state of an offline
    run with distinct images): wall time per mixed step with the piecewise graphs and with an eager
    forward, then the torch profiler's kernel table and cProfile's host functions of such steps."""
    from torch.profiler import ProfilerActivity, profile

    from mmserve import SamplingParams

    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i, im in enumerate(images[:num_decoding]):
        engine.add_request(f"mixed-d{i}", {"prompt": prompt, "images": [im]}, params)
    while any(r.num_output_tokens == 0 for r in engine.requests.values()):
        engine.step()
    new_images = images[num_decoding:]
    per_round = max(1, len(new_images) // 5)
    runner, piecewise = engine.runner, engine.runner.piecewise_graphs

    def mixed_round(tag: str, k: int, wrap=None) -> None:
        inputs = [
            engine.preprocess({"prompt": prompt, "images": [im]})
            for im in new_images[k * per_round : (k + 1) * per_round]
        ]
        for i, inp in enumerate(inputs):
            engine.add_processed(
                f"mixed-{tag}-{i}", inp, SamplingParams(max_tokens=1, temperature=0.0)
            )
        torch.cuda.synchronize()
        engine.step_stats.reset()
        steps = 0
        with wrap if wrap is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            while engine.scheduler.waiting or any(
                r.num_output_tokens == 0 for r in engine.requests.values()
            ):
                engine.step()
                steps += 1
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1000
        mixed = engine.step_stats.as_dict()["mixed"]
        print(
            f"mixed steps ({tag}): {num_decoding} decoding requests + {len(inputs)} new prompts: {steps} steps in "
            f"{wall:.1f} ms ({wall / steps:.1f} ms/step); mixed steps: {mixed['steps']}, host "
            f"{mixed['host_s'] * 1000 / max(1, mixed['steps']):.1f} ms/step, device wait "
            f"{mixed['device_wait_s'] * 1000 / max(1, mixed['steps']):.1f} ms/step"
        )

    mixed_round("warmup", 0)
    mixed_round("piecewise graphs", 1)
    runner.piecewise_graphs = None
    mixed_round("eager forward", 2)
    runner.piecewise_graphs = piecewise
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    mixed_round("piecewise graphs, torch profiler", 3, prof)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    host = cProfile.Profile()
    mixed_round("piecewise graphs, cProfile", 4, _profiling(host))
    pstats.Stats(host).sort_stats("tottime").print_stats(30)
    for rid in list(engine.requests):
        engine.abort(rid)


@contextlib.contextmanager
def _profiling(prof):
    prof.enable()
    try:
        yield
    finally:
        prof.disable()


def _prefix_hit_ttft(engine, prompt: str, question: str, image) -> None:
    """TTFT of a request, then of the same image + prompt again (prefix-, encoder- and prompt-end-cache hit),
    then of the same image with another question (`question`: prefix and encoder hits, one forward pass), each
    split into add_request (preprocessing) and the engine steps' host work and device waits."""
    from mmserve import SamplingParams

    def ttft(rid: str, text: str, img) -> tuple[float, float, dict, int]:
        torch.cuda.synchronize()
        engine.step_stats.reset()
        t0 = time.perf_counter()
        req = engine.add_request(
            rid, {"prompt": text, "images": [img]}, SamplingParams(max_tokens=1, temperature=0.0)
        )
        t_add = (time.perf_counter() - t0) * 1000
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
        kinds = engine.step_stats.as_dict()
        split = {
            "host": sum(v["host_s"] for v in kinds.values()) * 1000,
            "wait": sum(v.get("device_wait_s", 0.0) for v in kinds.values()) * 1000,
        }
        return (time.perf_counter() - t0) * 1000, t_add, split, req.num_cached_tokens

    miss, miss_add, miss_split, _ = ttft(f"miss-{id(image)}", prompt, image)
    hit, hit_add, hit_split, cached = ttft(f"hit-{id(image)}", prompt, image.copy())
    other, _, other_split, other_cached = ttft(f"question-{id(image)}", question, image.copy())
    print(
        f"prefix-cache TTFT: miss {miss:.2f} ms, hit {hit:.2f} ms ({cached} of the prompt's tokens cached), "
        f"hit/miss {hit / miss:.0%}; add_request miss {miss_add:.2f} / hit {hit_add:.2f} ms, engine steps' host "
        f"work {miss_split['host']:.2f} / {hit_split['host']:.2f} ms, device waits {miss_split['wait']:.2f} / "
        f"{hit_split['wait']:.2f} ms; another question on the picture {other:.2f} ms ({other_cached} cached), "
        f"{other / miss:.0%} of the miss (host {other_split['host']:.2f}, device waits {other_split['wait']:.2f} ms)"
    )


if __name__ == "__main__":
    main()
