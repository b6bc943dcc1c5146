"""The operator's stats line: every `interval_s` while the engine has work (and once more when it goes idle), one
log line with the prompt and generation throughput of the interval, running and waiting requests, KV cache usage,
and the prefix- and encoder-cache hit rates of the interval."""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("mmserve.stats")


class StatsLog:
    """Called by the engine loop after each step and while idle (`tick`); logs at most once per interval."""

    def __init__(self, engine: Any, interval_s: float = 10.0) -> None:
        self.engine, self.interval_s = engine, interval_s
        self._at = time.monotonic()
        self._prev = self._counts()

    def _counts(self) -> tuple[int, ...]:
        e = self.engine
        cache = e.runner.encoder.cache
        return (
            e.step_stats.prompt_tokens,
            e.step_stats.sampled_tokens,
            e.kv.stats.queried_tokens,
            e.kv.stats.hit_tokens,
            cache.hits + cache.misses,
            cache.hits,
        )

    def tick(self) -> str | None:
        """The line logged now, if the interval has passed and anything happened in it."""
        now = time.monotonic()
        if now - self._at < self.interval_s:
            return None
        counts, seconds = self._counts(), now - self._at
        d = [a - b for a, b in zip(counts, self._prev)]
        running, waiting = len(self.engine.scheduler.running), len(self.engine.scheduler.waiting)
        self._at, self._prev = now, counts
        if not any(d) and not running and not waiting:
            return None
        line = (
            f"stats: prompt {d[0] / seconds:,.1f} tok/s, generation {d[1] / seconds:,.1f} tok/s; "
            f"running {running}, waiting {waiting}; KV cache {100 * self.engine.kv.usage:.1f} % used; "
            f"prefix-cache hits {_share(d[3], d[2])}, encoder-cache hits {_share(d[5], d[4])} "
            f"(last {seconds:.0f} s)"
        )
        logger.info(line)
        return line


def _share(hits: int, queries: int) -> str:
    return f"{100 * hits / queries:.1f} %" if queries else "-"
