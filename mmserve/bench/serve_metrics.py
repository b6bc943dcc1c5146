"""What the load generator measures: a Record per request, and a sweep point's summary of them (latency
percentiles in ms over completed requests, rates over the point's wall time).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Record:
    """What one request measured; times are seconds since its send."""

    ok: bool = False
    chunk_times: list[float] = field(default_factory=list)  # each streamed piece of text
    e2e: float | None = None
    output_tokens: int = 0
    error: str | None = None


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    s = sorted(xs)

    def pct(p: float) -> float:
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": statistics.fmean(s), "p50": pct(50), "p99": pct(99), "max": s[-1]}


def summarize(records: list[Record], duration_s: float) -> dict[str, Any]:
    """Latency percentiles (ms) over completed requests; rates over the point's wall time."""
    ok = [r for r in records if r.ok]
    ttft = [r.chunk_times[0] * 1e3 for r in ok]
    itl = [
        (b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
    ]
    tpot = [
        (r.e2e - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
    ]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in records if r.error})
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration_s,
        "ttft_ms": _stats(ttft),
        "itl_ms": _stats(itl),
        "tpot_ms": _stats(tpot),
        "e2e_ms": _stats([r.e2e * 1e3 for r in ok]),
        "errors": errors[:5],
    }
