"""PNG plots of a bench result (matplotlib, optional: without it the plots are skipped with a note)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mmserve.bench.report_markdown import nested, serve_columns


def _plot_latency(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    rows = result["results"]
    bs = [r["batch_size"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("mmserve", "mmserve", "o-"), ("hf", "transformers", "s-")):
        ys = [nested(r, key, "decode_tok_s") for r in rows]
        if any(y is not None for y in ys):
            ax1.plot(bs, [math.nan if y is None else y for y in ys], style, label=label)
            ax2.plot(
                bs,
                [
                    math.nan if nested(r, key, "ttft_ms") is None else r[key]["ttft_ms"]
                    for r in rows
                ],
                style,
                label=label,
            )
    ax1.plot(bs, [r["roofline"]["tok_s"] for r in rows], "k--", label="bandwidth roofline")
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="batch size",
        ylabel="decode tok/s",
        title="decode throughput",
    )
    ax2.set(xlabel="batch size", ylabel="TTFT (ms, whole batch)", title="time to first token")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['env'].get('device_name')} — {result['env']['date']}", fontsize=9)
    path = out / "latency_tok_s_vs_batch.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return [path]


def _plot_throughput(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    res = result["results"]
    names = [n for n in ("mmserve", "hf") if res.get(n)]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(
        ["transformers" if n == "hf" else n for n in names], [res[n]["output_tok_s"] for n in names]
    )
    ax.set(
        ylabel="output tok/s",
        title=f"offline throughput ({result['config']['num_requests']} requests)",
    )
    path = out / "throughput_output_tok_s.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return [path]


def _plot_serve(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    res = result["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for sweep, ax, xkey in (
        (res["rate_sweep"], ax1, "requests_per_s"),
        (res["concurrency_sweep"], ax2, None),
    ):
        for (key, name), color in zip(serve_columns(result), ("C0", "C1"), strict=True):
            pts = [
                (row["concurrency"] if xkey is None else row[key][xkey], row[key]["ttft_ms"])
                for row in sweep
                if row.get(key) and row[key]["ttft_ms"]
            ]
            for q, style in (("p50", "o-"), ("p99", "^--")):
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1][q] for p in pts],
                        style,
                        color=color,
                        label=f"{name} TTFT {q}",
                    )
    concs = [row["concurrency"] for row in res["concurrency_sweep"]]
    if concs:
        ax2.set_xscale("log", base=2)
        ax2.minorticks_off()
        ax2.set_xticks(concs, [str(c) for c in concs])
    ax1.set(
        xlabel="achieved requests/s (Poisson arrivals)",
        ylabel="TTFT (ms)",
        title="TTFT vs request rate",
    )
    ax2.set(xlabel="concurrent requests", ylabel="TTFT (ms)", title="TTFT vs concurrency")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle(f"{result['config']['protocol']} — {result['env']['date']}", fontsize=9)
    path = out / f"serve_{result['config']['protocol']}_ttft_vs_load.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return [path]


_PLOTS = {"latency": _plot_latency, "throughput": _plot_throughput, "serve": _plot_serve}


def write_plots(result: dict[str, Any], plot_dir: str) -> list[str]:
    """PNG plots of this result into plot_dir; [] (and a note on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        print(
            "matplotlib is not installed: no plots (pip install 'mmserve[bench]')", file=sys.stderr
        )
        return []
    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return [str(p) for p in _PLOTS[result["bench"]](plt, result, out)]
    finally:
        plt.close("all")
