"""Bench results out: the JSON record, a markdown section (printed, and written or appended to a file) and
PNG plots (matplotlib, optional: without it the plots are skipped with a note).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _f(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, str):
        return x
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) >= 0.01 else f"{x:.2g}"


def _get(d: dict | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_f(c) for c in row) + " |" for row in rows]
    return lines


def _preamble(result: dict[str, Any]) -> list[str]:
    env, model = result["env"], result.get("model", {})
    if model.get("preset"):
        family = f"`{model['family']}` " if model.get("family") else ""
        where = f"random {family}`{model['preset']}` checkpoint"
    else:
        where = f"`{model.get('path')}`"
    return [
        f"### `mmserve bench {result['bench']}` — {env['date']}",
        "",
        f"- command: `{env['command']}`",
        f"- device: {env.get('device_name')} (`{env['device']}`), torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, mmserve {env.get('mmserve')}, python {env.get('python')}",
        f"- model: {where}, dtype {model.get('dtype') or result['config'].get('dtype')}"
        + (
            f", mmserve KV cache {result['config']['kv_cache_dtype']}"
            if result["config"].get("kv_cache_dtype", "auto") != "auto"
            else ""
        )
        + (
            f", mmserve weights {result['config']['quantization']} (decoder linears; transformers unquantized)"
            if result["config"].get("quantization")
            else ""
        )
        + (
            f", mmserve's language model over {result['config']['tensor_parallel_size']} GPUs (tensor parallel; "
            "transformers on one)"
            if result["config"].get("tensor_parallel_size", 1) > 1
            else ""
        )
        + (
            ", mmserve without CUDA graphs (--enforce-eager)"
            if result["config"].get("enforce_eager")
            else ""
        ),
    ]


def _latency_md(result: dict[str, Any]) -> list[str]:
    cfg, rows = result["config"], result["results"]
    prompt = next(
        (_get(r, n, "prompt_tokens") for r in rows for n in ("mmserve", "hf") if _get(r, n)), None
    )
    lines = _preamble(result) + [
        f"- prompt: 1 image + {result['model']['text_tokens']} text tokens = {prompt} tokens; "
        f"{cfg['output_len']} decode steps timed; {cfg['warmup']} warmup + {cfg['iters']} timed trials (median)",
        f"- device copy bandwidth: {_f(result['bandwidth']['gb_per_s'])} GB/s (read + write); roofline = "
        f"(LM weights + KV read per step) / that bandwidth",
        "",
    ]
    header = [
        "batch",
        "TTFT ms mmserve",
        "TTFT ms hf",
        "TTFT ratio",
        "ms/step mmserve",
        "ms/step hf",
        "ms/step roofline",
        "tok/s mmserve",
        "tok/s hf",
        "tok/s roofline",
        "tok/s ratio",
    ]
    body = [
        [
            r["batch_size"],
            _get(r, "mmserve", "ttft_ms"),
            _get(r, "hf", "ttft_ms"),
            _get(r, "ratio", "ttft"),
            _get(r, "mmserve", "decode_ms_per_step"),
            _get(r, "hf", "decode_ms_per_step"),
            _get(r, "roofline", "ms_per_step"),
            _get(r, "mmserve", "decode_tok_s"),
            _get(r, "hf", "decode_tok_s"),
            _get(r, "roofline", "tok_s"),
            _get(r, "ratio", "decode_tok_s"),
        ]
        for r in rows
    ]
    note = "Ratios are mmserve / hf (TTFT: lower is better; tok/s: higher is better)."
    return lines + _table(header, body) + ["", note]


def _images_note(cfg: dict[str, Any], model: dict[str, Any]) -> str:
    if not cfg.get("same_image"):
        return " (a distinct image per request)"
    return f" (one image shared by all requests, {model.get('distinct_texts', 1)} distinct texts)"


def _sampling_note(cfg: dict[str, Any]) -> str:
    if not cfg.get("temperature"):
        return "greedy"
    extra = "".join(
        f", {name} {cfg[key]}"
        for name, key, off in (("top-p", "top_p", 1.0), ("top-k", "top_k", 0))
        if cfg.get(key, off) != off
    )
    return f"sampled at temperature {cfg['temperature']}{extra}"


def _throughput_md(result: dict[str, Any]) -> list[str]:
    cfg, res = result["config"], result["results"]
    lines = _preamble(result) + [
        f"- {cfg['num_requests']} requests, each 1 image + {result['model']['text_tokens']} text tokens"
        f"{_images_note(cfg, result['model'])}, "
        f"{cfg['output_len']} output tokens (ignore_eos, {_sampling_note(cfg)}); "
        f"mmserve max_num_seqs {cfg['max_num_seqs']}, "
        f"transformers batches of {cfg['hf_batch_size']} (left-padded)",
        "",
    ]
    header = ["engine", "requests", "elapsed s", "requests/s", "output tok/s", "total tok/s"]
    body = []
    for name, label in (("mmserve", "mmserve"), ("hf", "transformers")):
        if res.get(name):
            r = res[name]
            body.append(
                [
                    label,
                    r["num_requests"],
                    r["elapsed_s"],
                    r["requests_per_s"],
                    r["output_tok_s"],
                    r["total_tok_s"],
                ]
            )
    if res.get("ratio"):
        ratio = res["ratio"]
        body.append(
            ["ratio mmserve/hf", None, None, ratio["requests_per_s"], ratio["output_tok_s"], None]
        )
    lines += _table(header, body)
    every = (res.get("mmserve") or {}).get("output_tok_s_every_round") or []
    if len(every) > 1:
        lines += [
            "",
            f"mmserve's output tok/s in each of its {len(every)} timed rounds (the table gives the best): "
            + ", ".join(f"{v:,.0f}" for v in every),
        ]
    steps = (res.get("mmserve") or {}).get("steps")
    if steps:
        lines += [
            "",
            "mmserve's engine steps by kind (host: scheduling, inputs, launches, outputs; device wait: "
            "blocked on the step's results):",
            "",
        ]
        rows = [
            [
                kind,
                t["steps"],
                t["tokens"],
                t["sequences"] / t["steps"],
                t["host_s"],
                t["device_wait_s"],
                t["wall_s"],
            ]
            for kind, t in steps.items()
            if kind != "idle" and t["steps"]
        ]
        lines += _table(
            [
                "step kind",
                "steps",
                "tokens",
                "sequences / step",
                "host s",
                "device wait s",
                "wall s",
            ],
            rows,
        )
    return lines


def _serve_md(result: dict[str, Any]) -> list[str]:
    cfg, res = result["config"], result["results"]
    lines = _preamble(result) + [
        f"- server: `{cfg['url']}` over `{cfg['protocol']}` (model `{result['model']['served_name']}`); "
        f"{cfg['num_requests']} requests per point, 1 image + {cfg['input_len']} text tokens, "
        f"{cfg['output_len']} output tokens; latencies in ms",
        "",
    ]
    header = [
        "point",
        "engine",
        "done/failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "E2E p50",
        "E2E p99",
    ]
    body = []
    for row in res["rate_sweep"] + res["concurrency_sweep"]:
        point = (
            f"rate {row['request_rate']}"
            if row["concurrency"] is None
            else f"concurrency {row['concurrency']}"
        )
        point += " (cut by time)" if row.get("truncated") else ""
        for name in ("mmserve", "hf"):
            m = row.get(name)
            if m:
                body.append(
                    [
                        point,
                        name,
                        f"{m['completed']}/{m['failed']}",
                        m["requests_per_s"],
                        m["output_tok_s"],
                        _get(m, "ttft_ms", "p50"),
                        _get(m, "ttft_ms", "p99"),
                        _get(m, "itl_ms", "p50"),
                        _get(m, "itl_ms", "p99"),
                        _get(m, "e2e_ms", "p50"),
                        _get(m, "e2e_ms", "p99"),
                    ]
                )
        if row.get("ratio"):
            rt = row["ratio"]
            body.append(
                [
                    point,
                    "ratio",
                    None,
                    rt["requests_per_s"],
                    rt["output_tok_s"],
                    rt["ttft_p50"],
                    None,
                    None,
                    None,
                    None,
                    None,
                ]
            )
    return lines + _table(header, body)


_MARKDOWN = {"latency": _latency_md, "throughput": _throughput_md, "serve": _serve_md}


def to_markdown(result: dict[str, Any]) -> str:
    lines = _MARKDOWN[result["bench"]](result)
    for err in result.get("errors", []):
        lines += ["", f"- error: `{err.strip().splitlines()[-1]}`"]
    return "\n".join(lines) + "\n"


# ---- plots ----------------------------------------------------------------------------------


def _plot_latency(plt: Any, result: dict[str, Any], out: Path) -> list[Path]:
    rows = result["results"]
    bs = [r["batch_size"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("mmserve", "mmserve", "o-"), ("hf", "transformers", "s-")):
        ys = [_get(r, key, "decode_tok_s") for r in rows]
        if any(y is not None for y in ys):
            ax1.plot(bs, [math.nan if y is None else y for y in ys], style, label=label)
            ax2.plot(
                bs,
                [math.nan if _get(r, key, "ttft_ms") is None else r[key]["ttft_ms"] for r in rows],
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
        for name, color in (("mmserve", "C0"), ("hf", "C1")):
            pts = [
                (row["concurrency"] if xkey is None else row[name][xkey], row[name]["ttft_ms"])
                for row in sweep
                if row.get(name) and row[name]["ttft_ms"]
            ]
            for q, style in (("p50", "o-"), ("p99", "^--")):
                if pts:
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1][q] for p in pts],
                        style,
                        color=color,
                        label=f"{'transformers' if name == 'hf' else name} TTFT {q}",
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


def write_outputs(
    result: dict[str, Any], out: str | None, markdown: str | None, plot_dir: str | None
) -> str:
    """Plots first (their paths go into the JSON), then the JSON file, then the markdown; returns the markdown."""
    if plot_dir:
        result["plots"] = write_plots(result, plot_dir)
    md = to_markdown(result)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(_plain(result), indent=2, allow_nan=False) + "\n")
    if markdown:
        path = Path(markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        gap = "\n" if path.exists() and path.stat().st_size else ""
        with open(path, "a") as f:
            f.write(gap + md)
    return md


def _plain(x: Any) -> Any:
    """Strict JSON: inf -> "inf", nan -> null, anything unknown -> str."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if math.isinf(x) else x)
    if x is None or isinstance(x, (str, int, bool)):
        return x
    return str(x)
