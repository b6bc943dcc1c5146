"""The Prometheus expositions of every replica as one: summed (`/metrics` of the Ray deployment) or side by side with
a `replica` label (`/metrics/replicas`).

Counters, histograms and counts add up over replicas (requests, tokens, cache queries and hits, KV blocks, queue
lengths); a ratio or rate gauge (`*_ratio`, `*_rate`: KV-cache usage, hit rates) is the replicas' mean, and an info
gauge (`*_info`, value: the scrape time) their latest. `*_created` samples (a counter's start time) are left out."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

from prometheus_client.parser import text_string_to_metric_families

MEAN_SUFFIXES = ("_ratio", "_rate")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _families(text: str) -> Iterator:
    """The exposition's families, less the `*_created` ones (a counter's start time, meaningless summed)."""
    return (f for f in text_string_to_metric_families(text) if not f.name.endswith("_created"))


def _header(family) -> list[str]:
    kind = "untyped" if family.type == "unknown" else family.type
    name = family.name + "_total" if kind == "counter" else family.name
    return [f"# HELP {name} {family.documentation}", f"# TYPE {name} {kind}"]


def _combine(name: str, values: list[float]) -> float:
    if name.endswith(MEAN_SUFFIXES):
        return sum(values) / len(values)
    if name.endswith("_info"):
        return max(values)
    return sum(values)


def summed(texts: Iterable[str]) -> str:
    """One exposition whose samples combine the replicas' (same name and labels)."""
    families: dict[str, object] = {}
    values: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for text in texts:
        for family in _families(text):
            families.setdefault(family.name, family)
            for s in family.samples:
                if not s.name.endswith("_created"):
                    key = (s.name, tuple(sorted(s.labels.items())))
                    values[family.name][key].append(s.value)
    lines = []
    for fname, family in families.items():
        lines += _header(family)
        for (sname, labels), vals in values[fname].items():
            lines.append(f"{sname}{_labels(dict(labels))} {_combine(fname, vals)!r}")
    return "\n".join(lines) + "\n"


def per_replica(texts: dict[str, str]) -> str:
    """One exposition holding every replica's samples, each with a `replica` label (its Ray replica id)."""
    families: dict[str, object] = {}
    samples: dict[str, list[str]] = defaultdict(list)
    for replica, text in texts.items():
        for family in _families(text):
            families.setdefault(family.name, family)
            for s in family.samples:
                if not s.name.endswith("_created"):
                    labels = {**s.labels, "replica": replica}
                    samples[family.name].append(f"{s.name}{_labels(labels)} {s.value!r}")
    lines = []
    for fname, family in families.items():
        lines += _header(family) + samples[fname]
    return "\n".join(lines) + "\n"
