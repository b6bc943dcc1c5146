"""Goodput under service-level objectives: `--goodput ttft:MS tpot:MS e2e:MS` (any subset), the requests per
second that met every objective and their share of the completed ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLO_KEYS = ("ttft", "tpot", "e2e")


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """{key: limit in ms} from `KEY:MS` items (space- or comma-separated); ValueError naming the bad key."""
    slos: dict[str, float] = {}
    for item in (part for spec in specs for part in spec.split(",")):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(
                f"--goodput: expected KEY:MS, got {item!r} (keys: {', '.join(SLO_KEYS)})"
            )
        if key not in SLO_KEYS:
            raise ValueError(
                f"--goodput: unknown key {key!r} in {item!r} (keys: {', '.join(SLO_KEYS)})"
            )
        if key in slos:
            raise ValueError(f"--goodput: key {key!r} given twice")
        try:
            limit = float(value)
        except ValueError:
            raise ValueError(
                f"--goodput: {key} needs a number of ms, got {value.strip()!r}"
            ) from None
        if not limit > 0:
            raise ValueError(f"--goodput: {key} must be > 0 ms, got {value.strip()!r}")
        slos[key] = limit
    return slos


@dataclass(frozen=True)
class RequestTimes:
    """One completed request's latencies in ms (tpot None for a single output token)."""

    ttft_ms: float
    e2e_ms: float
    tpot_ms: float | None


def goodput(
    times: list[RequestTimes], slos: dict[str, float], duration_s: float
) -> dict[str, Any] | None:
    """Requests/s meeting every objective (`tpot` counts as met for a one-token request), and their share of the
    completed requests; None without objectives."""
    if not slos:
        return None

    def met(t: RequestTimes) -> bool:
        values = {"ttft": t.ttft_ms, "e2e": t.e2e_ms, "tpot": t.tpot_ms}
        return all(values[k] is None or values[k] <= limit for k, limit in slos.items())

    good = sum(met(t) for t in times)
    return {
        "slo_ms": dict(slos),
        "good_requests": good,
        "goodput_requests_per_s": good / duration_s if duration_s > 0 else 0.0,
        "good_fraction": good / len(times) if times else 0.0,
    }
