"""The engine's host work per step, split by component, on any device (the CPU included).

`python scripts/host_profile.py` runs the throughput bench's shape (N requests, one distinct picture of 576
placeholders and ~128 text tokens each, 128 output tokens, greedy, ignore_eos; token budget 2048) through
`Engine.step` on a tiny random LLaVA and times each host function of the step directly (a clock read around it,
exclusive of the timed functions it calls; by default the engine thread's CPU time, which other processes on a
shared machine do not inflate, `--clock wall` for perf_counter). The device work (the language model's forward, the vision tower,
the logits and the sampler's tensor ops, which on the CPU run inline) is timed the same way and reported apart,
so the host columns hold only the engine's own Python work. `--coarse` leaves the functions called once per
request untimed (PER_REQUEST: at hundreds of calls a step, their clock reads would cost more than some of them do).
`--cprofile` also prints cProfile's functions of the whole run (mixed steps are most of its host work).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# (module, owner in it or None for a module function, attribute, component); a component is host work unless
# it is in DEVICE. Module functions are patched where the caller looks them up.
TIMED = (
    ("mmserve.engine.scheduler", "Scheduler", "schedule", "schedule"),
    ("mmserve.engine.engine", "Engine", "_launch", "advance"),
    ("mmserve.engine.engine", "Engine", "_record_step", "advance"),
    ("mmserve.engine.kv_cache", "KVCacheManager", "cache_computed_blocks", "kv blocks"),
    ("mmserve.engine.kv_cache", "KVCacheManager", "cache_computed_blocks_of", "kv blocks"),
    ("mmserve.worker.model_runner", "ModelRunner", "launch", "launch other"),
    ("mmserve.worker.model_runner", None, "flatten", "flatten"),
    ("mmserve.worker.step_execution", None, "attention_metadata", "attention metadata"),
    ("mmserve.worker.model_runner", None, "media_rows", "lora / media rows"),
    ("mmserve.worker.model_runner", None, "lora_rows", "lora / media rows"),
    ("mmserve.worker.encoder_runner", "EncoderRunner", "merge", "encoder inputs"),
    ("mmserve.worker.step_sampling", "StepSampling", "finish", "sampling other"),
    ("mmserve.worker.step_sampling", "StepSampling", "sample", "sampling other"),
    ("mmserve.worker.sampling_batch", "SamplingBatch", "build", "sampling batch"),
    ("mmserve.worker.sampling_batch", "SamplingBatch", "plain", "sampling batch"),
    ("mmserve.worker.launched_step", "LaunchedStep", "__init__", "launched step"),
    ("mmserve.engine.output_processor", "OutputProcessor", "resolve", "resolve other"),
    ("mmserve.worker.launched_step", "LaunchedStep", "result", "read back"),
    ("mmserve.engine.detokenizer", "IncrementalDetokenizer", "push", "detokenize"),
    ("mmserve.engine.detokenizer", "IncrementalDetokenizer", "flush", "detokenize"),
    ("mmserve.engine.output_processor", "OutputProcessor", "final_output", "outputs"),
    ("mmserve.engine.output_processor", None, "request_output", "outputs"),
    ("mmserve.engine.output_processor", None, "finish_status", "stop checks"),
    ("mmserve.engine.scheduler", "Scheduler", "finish", "outputs"),
    ("mmserve.worker.encoder_runner", "EncoderRunner", "encode_uncached", "device: vision tower"),
    ("mmserve.worker.sampler", "Sampler", "__call__", "device: sampler"),
    ("mmserve.worker.model_runner", None, "execute_step", "device: forward"),
)
# functions called once per request of a step (up to hundreds of calls): `--coarse` leaves them untimed, their time
# going to their callers', since timing a call costs more than some of them (two thread-time clock reads, ~0.6 us
# each on the CPU machine)
PER_REQUEST = frozenset(
    {
        ("KVCacheManager", "cache_computed_blocks"),
        ("IncrementalDetokenizer", "push"),
        ("IncrementalDetokenizer", "flush"),
        ("OutputProcessor", "final_output"),
        (None, "request_output"),
        (None, "finish_status"),
        ("Scheduler", "finish"),
    }
)
MODEL_METHODS = (  # the model instance's own tensor work, wherever the runner calls it from
    ("embed_input_ids", "device: forward"),
    ("compute_logits", "device: logits"),
)
GROUPS = {  # component -> the step phase it belongs to
    "schedule": "schedule",
    "flatten": "inputs",
    "attention metadata": "inputs",
    "lora / media rows": "inputs",
    "encoder inputs": "inputs",
    "sampling batch": "inputs",
    "launch other": "launch",
    "sampling other": "launch",
    "launched step": "launch",
    "advance": "launch",
    "kv blocks": "launch",  # registering full blocks: after a launch and after a read-back
    "read back": "resolve",
    "detokenize": "resolve",
    "stop checks": "resolve",
    "outputs": "resolve",
    "resolve other": "resolve",
    "step other": "step",
}


class StepTimers:
    """Exclusive perf_counter time of each timed function, by component, for the step being run."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.current: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # time of the timed callees of each open frame

    def wrap(self, fn: Callable, component: str) -> Callable:
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = self.clock() - t0
                inner = self._stack.pop()
                self.current[component] += took - inner
                if self._stack:
                    self._stack[-1] += took

        timed.__wrapped__ = fn
        return timed

    @contextlib.contextmanager
    def installed(self, model, per_request: bool = True) -> Iterator[None]:
        """Patch every TIMED function (those the engine has; per_request=False: not those of PER_REQUEST) and the
        model's MODEL_METHODS; undone on exit."""
        undo: list[tuple[Any, str, Any]] = []
        for module_name, owner_name, attr, component in TIMED:
            if not per_request and (owner_name, attr) in PER_REQUEST:
                continue
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            raw = vars(owner).get(attr)
            if raw is None:  # a function this version of the engine does not have
                continue
            undo.append((owner, attr, raw))
            if isinstance(raw, classmethod):
                setattr(owner, attr, classmethod(self.wrap(raw.__func__, component)))
            else:
                setattr(owner, attr, self.wrap(raw, component))
        for attr, component in MODEL_METHODS:
            undo.append((model, attr, None))
            setattr(model, attr, self.wrap(getattr(model, attr), component))
        try:
            yield
        finally:
            for owner, attr, raw in reversed(undo):
                if raw is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, raw)

    def take(self, total_s: float) -> dict[str, float]:
        """This step's components (seconds), with the untimed rest of Engine.step as 'step other'."""
        out, self.current = dict(self.current), defaultdict(float)
        out["step other"] = total_s - sum(out.values())
        return out


def build_model(out_dir: Path, image_size: int, max_position: int, text_layers: int) -> Path:
    """A tiny random LLaVA whose pictures expand to (image_size / 14)^2 placeholders, as LLaVA-1.5's 576 (fewer
    decoder layers than the tiny preset's 3 only shorten the run: the engine's host work does not depend on them)."""
    from mmserve.testing import make_llava_checkpoint

    return make_llava_checkpoint(
        out_dir,
        preset="tiny",
        seed=0,
        image_size=image_size,
        max_position=max_position,
        text_layers=text_layers,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload; the per-step components of the steps of `args.kind` (means, ms) and the step shapes."""
    import torch

    from mmserve import LLM, SamplingParams
    from mmserve.bench.workload import PromptTemplate, make_images, make_prompt

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    model_dir = str(
        args.model
        or build_model(
            Path(tmp.name) / "llava", args.image_size, args.max_position, args.text_layers
        )
    )
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_size_gb=4.0,
    )
    engine = llm.engine
    spec = make_prompt(PromptTemplate(model_dir), args.input_len)
    images = make_images(args.num_requests, args.image_size, seed=args.seed)
    inputs = [engine.preprocess({"prompt": spec.text, "images": [im]}) for im in images]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, inp in enumerate(inputs):
        engine.add_processed(f"r{i}", inp, params, stream=args.stream)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    timers = StepTimers(clock)
    steps: list[dict[str, Any]] = []
    profiler = cProfile.Profile() if args.cprofile else None
    finished = 0
    scheduled: list = []
    sch = (
        engine.scheduler
    )  # the class's method, timed once installed: its outputs give the step shapes
    sch.schedule = lambda: scheduled.append(type(sch).schedule(sch)) or scheduled[-1]
    with timers.installed(engine.model, per_request=not args.coarse):
        while engine.has_unfinished():
            if profiler is not None:
                profiler.enable()
            t0 = clock()
            outs = engine.step()
            total = clock() - t0
            if profiler is not None:
                profiler.disable()
            finished += sum(o.finished for o in outs)
            sched = scheduled.pop()
            shape = (
                (sched.kind, sched.num_batched_tokens, len(sched.scheduled))
                if sched.scheduled
                else ("idle", 0, 0)
            )
            steps.append({"shape": shape, "parts": timers.take(total)})
    if finished != args.num_requests:
        raise RuntimeError(f"{finished} of {args.num_requests} requests finished")
    llm.close()
    tmp.cleanup()
    report = summarize([s for s in steps if s["shape"][0] == args.kind], args.kind)
    report["all_steps"] = len(steps)
    if profiler is not None:
        report["cprofile"] = profiler
    return report


def summarize(steps: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Medians over `steps` (ms per step): each component, each phase (the sum of its components' medians), the
    host total and the device total."""
    if not steps:
        raise RuntimeError(f"no {kind} steps ran")
    names = sorted({name for s in steps for name in s["parts"]})
    # medians: the machine may be shared, and a step that another process delayed should not move the numbers
    comp = {n: 1000 * statistics.median(s["parts"].get(n, 0.0) for s in steps) for n in names}
    means = {n: 1000 * statistics.fmean(s["parts"].get(n, 0.0) for s in steps) for n in names}
    host = {n: v for n, v in comp.items() if not n.startswith("device")}
    phases: dict[str, float] = defaultdict(float)
    for n, v in host.items():
        phases[GROUPS.get(n, n)] += v
    host_totals = sorted(
        1000 * sum(v for n, v in s["parts"].items() if not n.startswith("device")) for s in steps
    )
    return {
        "kind": kind,
        "host_ms_p10_p90": (
            host_totals[len(host_totals) // 10],
            host_totals[len(host_totals) * 9 // 10],
        ),
        "steps": len(steps),
        "mean_tokens": statistics.fmean(s["shape"][1] for s in steps),
        "mean_seqs": statistics.fmean(s["shape"][2] for s in steps),
        "host_ms": statistics.median(host_totals),
        "device_ms": sum(v for n, v in comp.items() if n.startswith("device")),
        "phases_ms": dict(phases),
        "components_ms": comp,
        "components_mean_ms": means,
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"{report['steps']} {report['kind']} steps of {report['all_steps']} "
        f"(~{report['mean_tokens']:.0f} tokens, ~{report['mean_seqs']:.0f} sequences): host "
        f"{report['host_ms']:.2f} ms/step (p10 {report['host_ms_p10_p90'][0]:.2f}, p90 "
        f"{report['host_ms_p10_p90'][1]:.2f}), device work (inline here, excluded) {report['device_ms']:.2f} ms/step"
    )
    for phase, ms in sorted(report["phases_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {phase:<10} {ms:7.3f} ms")
        for name, v in sorted(report["components_ms"].items(), key=lambda kv: -kv[1]):
            if GROUPS.get(name, name) == phase and not name.startswith("device"):
                mean = report["components_mean_ms"][name]
                print(f"    {name:<20} {v:7.3f} ms (mean {mean:.3f})")
    for name, v in sorted(report["components_ms"].items()):
        if name.startswith("device"):
            print(f"  ({name:<20} {v:7.3f} ms)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="host_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint (default: a tiny random LLaVA built here)")
    ap.add_argument(
        "--device",
        default="cpu",
        help="cuda: the device work is queued, so its columns are the host's launch time of that work",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=128, help="text tokens per prompt")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument(
        "--image-size", type=int, default=336, help="336: 576 placeholders, as LLaVA-1.5"
    )
    ap.add_argument("--max-position", type=int, default=1024)
    ap.add_argument("--text-layers", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--stream", action="store_true", help="per-token outputs (a server's requests)")
    ap.add_argument("--kind", default="mixed", choices=["mixed", "decode", "prefill"])
    ap.add_argument(
        "--clock",
        default="thread",
        choices=["thread", "wall"],
        help="thread: the engine thread's CPU time (steady on a shared machine); wall: perf_counter",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (device work)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--coarse",
        action="store_true",
        help="leave the functions called per request (PER_REQUEST) untimed: a truer host total",
    )
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    report = run(args)
    print_report(report)
    profiler = report.pop("cprofile", None)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if profiler is not None:
        # the engine's own host functions (the forward's layers and kernels left out)
        stats = pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime")
        stats.print_stats(r"mmserve/(engine|worker|core|sampling_params)", 40)


if __name__ == "__main__":
    main()
