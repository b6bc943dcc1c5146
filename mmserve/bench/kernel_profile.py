"""Where a whole run's GPU time goes: a torch-profiler trace of every kernel, summed by kind of work.

`profiled(out_dir)` wraps a block (an offline `LLM.generate` round) in the torch profiler with CUDA activity
only; on exit it writes the Chrome trace (`trace.json.gz`) and `kernels.md`: wall time, the time some kernel
or copy was running (the union of their intervals), the idle time between them (and how much of it came in
gaps of over 100 µs, which is host-bound time), the time per kind of work and the top kernels. Kernels inside
CUDA graphs are traced one by one.

With programmatic dependent launch (on by default on Hopper) a kernel starts while the one before it finishes and
waits for it, so kernels' own durations overlap and inflate the small ones. Each row therefore also gets its
*exclusive* time: every instant of busy time goes to the earliest-started kernel still running then (the one doing
the work; the later one is waiting), so exclusive times add up to the busy time.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

# first match wins; names are the CUDA kernel names the profiler records
KERNEL_KINDS: tuple[tuple[str, str], ...] = (
    ("decode attention", r"_decode_kernel|_decode_rows_kernel|_decode_reduce_kernel"),
    ("prefill attention (paged)", r"_prefill_kernel"),
    ("vision / SDPA attention", r"flash|fmha|attention|efficient_attention"),
    ("GEMV (batch 1)", r"_gemv_kernel"),
    ("FP8 GEMM (triton)", r"_fp8_gemm_kernel"),
    ("GEMM (cuBLAS / CUTLASS)", r"gemm|nvjet|xmma|cutlass|sm90|sm80|s16816|_mm_|matmul"),
    ("activation quantization", r"_quant_rows_kernel"),
    ("SiLU-and-mul (+quant)", r"_silu_and_mul"),
    ("RMSNorm (+residual)", r"_rms_norm_kernel|rms_norm|layer_norm|LayerNorm"),
    ("rotary + cache write", r"_rotary|_reshape_and_cache"),
    ("sampling", r"_sample_kernel|argmax|softmax|topk|sort|multinomial"),
    ("copies / fills", r"copy|Memcpy|Memset|fill|cat|index|gather|scatter"),
    ("elementwise / other torch", r"elementwise|vectorized|reduce|unrolled"),
)
IDLE_GAP_US = 100.0


@dataclass
class KernelSummary:
    """One profiled block's GPU time, in microseconds except `wall_s`."""

    wall_s: float = 0.0
    busy_us: float = 0.0
    idle_us: float = 0.0
    idle_long_us: float = 0.0  # idle time in gaps longer than IDLE_GAP_US
    long_gaps: int = 0
    # kind / kernel name -> [calls, total µs of their durations, exclusive µs]
    kinds: dict[str, list[float]] = field(default_factory=dict)
    kernels: dict[str, list[float]] = field(default_factory=dict)

    def markdown(self, top: int = 30) -> str:
        busy_s, idle_s = self.busy_us / 1e6, self.idle_us / 1e6
        lines = [
            f"wall {self.wall_s:.3f} s; a kernel or copy running {busy_s:.3f} s; idle between them "
            f"{idle_s:.3f} s, of which {self.idle_long_us / 1e6:.3f} s in {self.long_gaps} gaps over "
            f"{IDLE_GAP_US:.0f} µs",
            "",
            "| kind of work | calls | exclusive s | share of busy | durations s |",
            "|---|---|---|---|---|",
        ]
        for kind, (calls, us, excl) in sorted(self.kinds.items(), key=lambda kv: -kv[1][2]):
            lines.append(
                f"| {kind} | {int(calls):,} | {excl / 1e6:.3f} | {100 * excl / max(self.busy_us, 1):.1f} % "
                f"| {us / 1e6:.3f} |"
            )
        lines += [
            "",
            "| kernel | calls | exclusive ms | mean exclusive µs | mean duration µs |",
            "|---|---|---|---|---|",
        ]
        for name, (calls, us, excl) in sorted(self.kernels.items(), key=lambda kv: -kv[1][2])[:top]:
            lines.append(
                f"| `{name[:90]}` | {int(calls):,} | {excl / 1e3:.1f} | {excl / calls:.1f} | {us / calls:.1f} |"
            )
        return "\n".join(lines) + "\n"


def kind_of(name: str) -> str:
    for kind, pattern in KERNEL_KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def summarize(events: list[dict], wall_s: float) -> KernelSummary:
    """Sum Chrome-trace device events ('kernel', 'gpu_memcpy', 'gpu_memset' with ts/dur in µs)."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"]) for e in events
    )
    s = KernelSummary(wall_s=wall_s)
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    end = None  # the latest end of the spans so far: time before it belongs to an earlier-started span
    for start, stop, name in spans:
        if end is not None and start > end:
            gap = start - end
            s.idle_us += gap
            if gap > IDLE_GAP_US:
                s.idle_long_us += gap
                s.long_gaps += 1
        exclusive = max(0.0, stop - max(start, end if end is not None else start))
        s.busy_us += exclusive
        end = stop if end is None else max(end, stop)
        for row in (kinds[kind_of(name)], kernels[name]):
            row[0] += 1
            row[1] += stop - start
            row[2] += exclusive
    s.kinds, s.kernels = dict(kinds), dict(kernels)
    return s


def device_events(trace_path: str) -> list[dict]:
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        trace = json.load(f)
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


@contextlib.contextmanager
def profiled(out_dir: str) -> Iterator[None]:
    """Profile the block's CUDA activity; write trace.json.gz and kernels.md under out_dir."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    # without a GPU there is nothing to trace but the summary's wall time
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        yield
        sync()
        wall = time.perf_counter() - t0
    trace = os.path.join(out_dir, "trace.json")
    prof.export_chrome_trace(trace)
    summary = summarize(device_events(trace), wall)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(trace)
    with open(os.path.join(out_dir, "kernels.md"), "w") as f:
        f.write(summary.markdown())
