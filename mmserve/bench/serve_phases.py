"""Where a served request's time to its first response bytes goes: the server's `mmserve_request_phase_seconds`
histogram (entrypoints/metrics.py) read from /metrics before and after a run, as mean (and estimated quantile)
milliseconds per phase over the requests in between."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mmserve.core.outputs import PHASES

PHASE_METRIC = "mmserve_request_phase_seconds"


def parse_phases(text: str) -> dict[str, dict]:
    """{phase: {"count", "sum" (seconds), "buckets": [(upper bound, cumulative count), ...]}} of a /metrics text,
    summed over the label sets of one phase (model names)."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name != PHASE_METRIC:
            continue
        for s in family.samples:
            phase = s.labels.get("phase")
            if phase is None:
                continue
            entry = out.setdefault(phase, {"count": 0.0, "sum": 0.0, "buckets": {}})
            if s.name.endswith("_count"):
                entry["count"] += s.value
            elif s.name.endswith("_sum"):
                entry["sum"] += s.value
            elif s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                entry["buckets"][le] = entry["buckets"].get(le, 0.0) + s.value
    for entry in out.values():
        entry["buckets"] = sorted(entry["buckets"].items())
    return out


def scrape_phases(metrics_url: str, timeout: float = 30.0) -> dict[str, dict]:
    """parse_phases of the server's /metrics (`metrics_url`, e.g. http://127.0.0.1:8000/metrics)."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as resp:  # noqa: S310 - the caller's server
        return parse_phases(resp.read().decode("utf-8"))


def _delta(before: dict, after: dict, phase: str) -> dict:
    a, b = after.get(phase), before.get(phase, {"count": 0.0, "sum": 0.0, "buckets": []})
    if a is None:
        return {"count": 0.0, "sum": 0.0, "buckets": []}
    earlier = dict(b["buckets"])
    buckets = [(le, n - earlier.get(le, 0.0)) for le, n in a["buckets"]]
    return {"count": a["count"] - b["count"], "sum": a["sum"] - b["sum"], "buckets": buckets}


def phase_breakdown(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per phase (in PHASES order) over the requests recorded between two scrapes; NaN for a
    phase no request reached."""
    out = {}
    for phase in PHASES:
        d = _delta(before, after, phase)
        out[phase] = 1000.0 * d["sum"] / d["count"] if d["count"] > 0 else math.nan
    return out


def phase_quantiles(before: dict, after: dict, q: float = 0.5) -> dict[str, float]:
    """The q-quantile milliseconds per phase between two scrapes, estimated as Prometheus' histogram_quantile does
    (linear within the bucket that holds it, so only as fine as the buckets); NaN without requests."""
    out = {}
    for phase in PHASES:
        d = _delta(before, after, phase)
        out[phase] = math.nan
        if d["count"] <= 0:
            continue
        rank, lower, below = q * d["count"], 0.0, 0.0
        for le, cumulative in d["buckets"]:
            if cumulative >= rank:
                if math.isinf(le):  # above the last finite bucket: its bound is all we know
                    out[phase] = 1000.0 * lower
                else:
                    share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
                    out[phase] = 1000.0 * (lower + (le - lower) * share)
                break
            lower, below = le, cumulative
    return out
