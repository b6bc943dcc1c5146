"""Bench results out: the JSON record (strict JSON), a markdown section (bench/report_markdown.py; printed, and
written or appended to a file) and PNG plots (bench/report_plots.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mmserve.bench.report_markdown import to_markdown
from mmserve.bench.report_plots import write_plots


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
