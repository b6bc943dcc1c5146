"""The markdown section of a bench result: a preamble (command, device, model) and the tables of its bench
(latency, throughput or serve), with the run's errors last.
"""

from __future__ import annotations

import math
from typing import Any


def _f(x: Any) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, str):
        return x
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}" if abs(x) >= 0.01 else f"{x:.2g}"


def nested(d: dict | None, *keys: str) -> Any:
    """d[keys[0]][keys[1]]...; None where a level is missing or not a dict."""
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
        (nested(r, n, "prompt_tokens") for r in rows for n in ("mmserve", "hf") if nested(r, n)),
        None,
    )
    lines = _preamble(result) + [
        f"- prompt: {_pictures(cfg)} + {result['model']['text_tokens']} text tokens = {prompt} tokens; "
        f"{cfg['output_len']} decode steps timed; {cfg['warmup']} warmup + {cfg['iters']} timed trials (median)",
        f"- device copy bandwidth: {_f(result['bandwidth']['gb_per_s'])} GB/s (read + write); roofline = "
        f"(LM weights + KV read per step) / that bandwidth",
        *_memory_line(result.get("memory")),
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
            nested(r, "mmserve", "ttft_ms"),
            nested(r, "hf", "ttft_ms"),
            nested(r, "ratio", "ttft"),
            nested(r, "mmserve", "decode_ms_per_step"),
            nested(r, "hf", "decode_ms_per_step"),
            nested(r, "roofline", "ms_per_step"),
            nested(r, "mmserve", "decode_tok_s"),
            nested(r, "hf", "decode_tok_s"),
            nested(r, "roofline", "tok_s"),
            nested(r, "ratio", "decode_tok_s"),
        ]
        for r in rows
    ]
    note = "Ratios are mmserve / hf (TTFT: lower is better; tok/s: higher is better)."
    return lines + _table(header, body) + ["", note]


def _memory_line(memory: dict[str, Any] | None) -> list[str]:
    if not memory:
        return []
    peak = memory.get("peak_allocated_gib")
    return [
        f"- mmserve's device memory (first rank): weights {_f(memory['weights_gib'])} GiB as stored, KV pool "
        f"{_f(memory['kv_cache_gib'])} GiB"
        + (f", peak allocated {_f(peak)} GiB" if peak is not None else "")
    ]


def _pictures(cfg: dict[str, Any]) -> str:
    n, size = cfg.get("images_per_request", 1), cfg.get("image_size")
    return (f"{n} image" if n == 1 else f"{n} images") + (f" of {size}²" if size else "")


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
    model = result["model"]
    if model.get("dataset"):
        cycled = f", its {model['distinct_lines']} lines cycled" if model.get("cycled") else ""
        lens = "--output-len" if model["output_len_from"] == "--output-len" else "each line's"
        what = f"from `{model['dataset']}`{cycled}, {lens} output length (ignore_eos, {_sampling_note(cfg)})"
    else:
        what = (
            f"each 1 image + {model['text_tokens']} text tokens{_images_note(cfg, model)}, "
            f"{cfg['output_len']} output tokens (ignore_eos, {_sampling_note(cfg)})"
        )
    lines = _preamble(result) + [
        f"- {cfg['num_requests']} requests, {what}; mmserve max_num_seqs {cfg['max_num_seqs']}, "
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
    good = nested(res, "mmserve", "goodput")
    if good:
        limits = ", ".join(f"{k} ≤ {_f(v)} ms" for k, v in good["slo_ms"].items())
        lines += [
            "",
            f"mmserve's goodput ({limits}, every request sent at the start): "
            f"{_f(good['goodput_requests_per_s'])} requests/s, {good['good_requests']} of "
            f"{res['mmserve']['num_requests']} requests ({_f(100 * good['good_fraction'])} %)",
        ]
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


def serve_columns(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(row key, name) of a serve result's engines: the measured server, then the transformers baseline. Results
    written before the server had a label keep its numbers under "mmserve"."""
    labels = result.get("labels") or {}
    key = "server" if labels else "mmserve"
    return [(key, labels.get("server", "mmserve")), ("hf", labels.get("hf", "transformers"))]


def _point(row: dict[str, Any]) -> str:
    point = (
        f"rate {row['request_rate']}"
        if row["concurrency"] is None
        else f"concurrency {row['concurrency']}"
    )
    return point + (" (cut by time)" if row.get("truncated") else "")


def _serve_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return result["results"]["rate_sweep"] + result["results"]["concurrency_sweep"]


def _workload_note(result: dict[str, Any]) -> str:
    cfg, work = result["config"], result.get("workload") or {}
    if work.get("source") == "dataset":
        lens = "--output-len" if work["output_len_from"] == "--output-len" else "each line's"
        cycled = f", its {work['distinct_lines']} lines cycled" if work.get("cycled") else ""
        return (
            f"{cfg['num_requests']} requests per point from `{work['dataset']}`{cycled} "
            f"({_f(work['pictures_per_request'])} pictures per request, {lens} output length; the same "
            "requests at every point)"
        )
    return (
        f"{cfg['num_requests']} requests per point, 1 image + {cfg['input_len']} text tokens, "
        f"{cfg['output_len']} output tokens"
    )


def _serve_table(result: dict[str, Any]) -> list[str]:
    header = ["point", "engine", "done/failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99"]
    header += ["ITL p50", "ITL p99", "E2E p50", "E2E p99"]
    body = []
    for row in _serve_rows(result):
        for key, name in serve_columns(result):
            m = row.get(key)
            if m:
                body.append(
                    [_point(row), name, f"{m['completed']}/{m['failed']}", m["requests_per_s"]]
                    + [m["output_tok_s"]]
                    + [
                        nested(m, k, q)
                        for k in ("ttft_ms", "itl_ms", "e2e_ms")
                        for q in ("p50", "p99")
                    ]
                )
        if row.get("ratio"):
            rt = row["ratio"]
            ratio = [rt["requests_per_s"], rt["output_tok_s"], rt["ttft_p50"]]
            body.append([_point(row), "ratio", None, *ratio, None, None, None, None, None])
    return _table(header, body)


def _serve_goodput(result: dict[str, Any]) -> list[str]:
    slos = result["config"].get("goodput")
    if not slos:
        return []
    limits = ", ".join(f"{k} ≤ {_f(v)} ms" for k, v in slos.items())
    body = [
        [_point(row), name, g["good_requests"], g["goodput_requests_per_s"], g["good_fraction"]]
        for row in _serve_rows(result)
        for key, name in serve_columns(result)
        if (g := nested(row, key, "goodput"))
    ]
    header = ["point", "engine", "good requests", "goodput req/s", "share of completed"]
    return [
        f"Goodput: requests meeting every objective ({limits}; tpot: one-token requests meet it)",
        "",
    ] + (_table(header, body))


def _serve_phases(result: dict[str, Any]) -> list[str]:
    rows = [row for row in _serve_rows(result) if row.get("phases")]
    if not rows:
        return []
    names = list(rows[0]["phases"]["mean_ms"])
    body = [
        [_point(row)] + [f"{_f(ph['mean_ms'][n])} ({_f(ph['p50_ms'][n])})" for n in names]
        for row in rows
        if (ph := row["phases"])
    ]
    return [
        "Where the first token's time goes on the server (`mmserve_request_phase_seconds`): mean (p50) ms per "
        "request; p50 from the histogram's buckets",
        "",
    ] + _table(["point", *names], body)


# The serve report's sections after its preamble, in order; each gives its lines ([] to leave itself out).
SERVE_SECTIONS = (_serve_table, _serve_goodput, _serve_phases)


def _serve_md(result: dict[str, Any]) -> list[str]:
    cfg = result["config"]
    lines = _preamble(result) + [
        f"- server: `{cfg['url']}` over `{cfg['protocol']}` (model `{result['model']['served_name']}`, "
        f"named {serve_columns(result)[0][1]}); {_workload_note(result)}; latencies in ms",
    ]
    for section in SERVE_SECTIONS:
        part = section(result)
        if part:
            lines += [""] + part
    return lines


_MARKDOWN = {"latency": _latency_md, "throughput": _throughput_md, "serve": _serve_md}


def to_markdown(result: dict[str, Any]) -> str:
    """The markdown section of one bench result, its errors last."""
    lines = _MARKDOWN[result["bench"]](result)
    for err in result.get("errors", []):
        lines += ["", f"- error: `{err.strip().splitlines()[-1]}`"]
    return "\n".join(lines) + "\n"
