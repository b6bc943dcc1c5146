"""The operator's stats line (engine/stats_log.py) over a real engine: throughput, queue, KV usage and cache hit rates
of the interval; nothing when nothing happened."""

from __future__ import annotations

import re

from mmserve import LLM, SamplingParams
from mmserve.engine.stats_log import StatsLog
from mmserve.testing import make_test_image


def test_a_busy_interval_gives_a_line_and_an_idle_one_none(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32")
    stats = StatsLog(llm.engine, interval_s=0.0)
    assert stats.tick() is None  # nothing happened yet
    prompt = {"prompt": "USER: <image>\nHi ASSISTANT:", "images": [make_test_image(5)]}
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    llm.generate([prompt, prompt], params, use_tqdm=False)  # the second: prefix and encoder hits
    line = stats.tick()
    m = re.fullmatch(
        r"stats: prompt ([\d,.]+) tok/s, generation ([\d,.]+) tok/s; running 0, waiting 0; KV cache "
        r"[\d.]+ % used; prefix-cache hits ([\d.]+) %, encoder-cache hits (-|[\d.]+ %) \(last \d+ s\)",
        line,
    )
    assert m, line
    assert float(m[1].replace(",", "")) > 0 and float(m[2].replace(",", "")) > 0
    assert float(m[3]) > 0  # the repeat hit the prefix cache
    assert llm.engine.step_stats.sampled_tokens == 12
    assert stats.tick() is None  # idle since
