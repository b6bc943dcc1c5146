"""What the load generator measures: a Record per request, and a sweep point's summary of them (latency
percentiles in ms over completed requests, rates over the point's wall time).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from mmserve.bench.goodput import RequestTimes, goodput


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


def request_times(r: Record) -> RequestTimes:
    """A completed request's TTFT, E2E and TPOT (ms) from its record."""
    assert r.e2e is not None
    tpot = (r.e2e - r.chunk_times[0]) * 1e3 / (r.output_tokens - 1) if r.output_tokens > 1 else None
    return RequestTimes(ttft_ms=r.chunk_times[0] * 1e3, e2e_ms=r.e2e * 1e3, tpot_ms=tpot)


def summarize(
    records: list[Record], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """Latency percentiles (ms) over completed requests; rates over the point's wall time; goodput under `slos`
    (ms per key of bench/goodput.py) when given."""
    ok = [r for r in records if r.ok]
    itl = [
        (b - a) * 1e3 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
    ]
    times = [request_times(r) for r in ok]
    tpot = [t.tpot_ms for t in times if t.tpot_ms is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in records if r.error})
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration_s,
        "ttft_ms": _stats([t.ttft_ms for t in times]),
        "itl_ms": _stats(itl),
        "tpot_ms": _stats(tpot),
        "e2e_ms": _stats([t.e2e_ms for t in times]),
        "errors": errors[:5],
        "goodput": goodput(times, slos or {}, duration_s),
    }
