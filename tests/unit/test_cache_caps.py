"""The caches that fill with traffic stay within their caps, in entries and in bytes (issue 30), and the startup line
names them."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import torch

from mmserve.engine import engine as engine_module
from mmserve.multimodal.placeholder_expansion import PlaceholderExpansion, pack_run, unpack_run
from mmserve.multimodal.processors import BoundedLRU
from mmserve.testing import make_test_image


def test_bounded_lru_keeps_its_entry_and_byte_caps():
    lru = BoundedLRU(3, 100, size_of=len)
    for key in "abc":
        lru.put(key, "x" * 30)
    assert len(lru) == 3 and lru.nbytes == 90
    assert lru.get("a") == "x" * 30  # a is now the most recently used
    lru.put("d", "y" * 30)  # four entries: b, the least recently used, goes
    assert lru.get("b") is None and len(lru) == 3 and lru.nbytes == 90
    lru.put("e", "z" * 60)  # 150 bytes: c and a go
    assert [k for k in "acde" if lru.get(k) is not None] == ["d", "e"] and lru.nbytes == 90
    lru.put("d", "w" * 10)  # a new value for a key replaces its bytes
    assert lru.nbytes == 70 and lru.get("d") == "w" * 10
    lru.put("big", "q" * 101)  # larger than the whole cap: not kept, nothing evicted
    assert lru.get("big") is None and len(lru) == 2 and lru.nbytes == 70
    lru.clear()
    assert len(lru) == 0 and lru.nbytes == 0


def test_processed_prompts_are_capped_in_bytes(tiny_llava_dir):
    from mmserve.models.loader import load_hf_config
    from mmserve.models.registry import get_model_class
    from mmserve.multimodal.bounded_lru import inputs_bytes
    from mmserve.multimodal.processors import InputProcessor

    hf_config = load_hf_config(tiny_llava_dir)
    proc = InputProcessor(tiny_llava_dir, hf_config, get_model_class(hf_config))

    def prompt(seed):
        return {
            "prompt": "USER: <image>\nWhat is this? ASSISTANT:",
            "images": [make_test_image(seed)],
        }

    first = proc.process(prompt(1))
    size = inputs_bytes(first)
    pixels = first.mm_items[0].data["pixel_values"].nbytes
    assert size >= pixels + 40 * len(first.prompt_token_ids)
    assert proc.process(prompt(1)) is first  # an exact repeat is served from the cache
    proc._recent.max_bytes = 2 * size + size // 2  # room for two such prompts
    for seed in (2, 3):
        proc.process(prompt(seed))
    assert len(proc._recent) == 2 and proc._recent.nbytes <= proc._recent.max_bytes
    assert proc.process(prompt(1)) is not first  # the oldest went for the bytes, not the count
    proc._recent.max_bytes = size - 1  # smaller than one prompt: none is kept
    proc.clear_recent()
    again = proc.process(prompt(4))
    assert proc.process(prompt(4)) is not again and len(proc._recent) == 0


def test_expansions_are_kept_run_length_encoded():
    for run in [(9, 9, 9), (9,), (9, 9, 8, 9, 9, 7), tuple([32000] * 576)]:
        assert unpack_run(pack_run(run)) == run
    assert len(pack_run([32000] * 576)) == 2  # one (id, repeat) pair
    exp = PlaceholderExpansion(lambda text: None, 32000)
    exp.verified = True  # as after the first run's check against the processor
    ids = torch.tensor([[1] + [32000] * 576 + [2]])
    enc = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    tracemalloc.start()
    try:
        for i in range(
            PlaceholderExpansion.MAX_SIZES + 100
        ):  # pictures of new sizes, LLaVA-1.5's 576 placeholders
            exp.learn([(300 + i, 200)], enc, "IMG", lambda: {})
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(exp._expansions) == PlaceholderExpansion.MAX_SIZES
    assert held < 2.5 * 2**20, held  # ~1 MB; as tuples of Python ints: ~91 MB
    assert exp.expansions_for([(300 + PlaceholderExpansion.MAX_SIZES, 200)]) == [
        tuple([32000] * 576)
    ]


def test_learning_sizes_stores_packed_runs():
    exp = PlaceholderExpansion(lambda text: SimpleNamespace(input_ids=[5, 9, 6]), 9)
    t = torch.tensor([[5] + [9] * 40 + [6]])
    outputs = lambda: {"pixel_values": torch.zeros(1, 3, 2, 2)}  # noqa: E731
    exp.learn(
        [(7, 7)],
        {
            "input_ids": t,
            "attention_mask": torch.ones_like(t),
            "pixel_values": torch.zeros(1, 3, 2, 2),
        },
        "a IMG b",
        outputs,
    )
    assert exp.verified is True
    assert list(exp._expansions[(7, 7, 1)]) == [9, 40] and exp.expansions_for([(7, 7)]) == [
        (9,) * 40
    ]


def test_slow_step_shapes_are_capped(monkeypatch):
    monkeypatch.setattr(engine_module, "SLOW_SHAPES_KEPT", 3)
    fake = SimpleNamespace(_slow_shapes=set(), _slow_logged_at=float("-inf"))
    for tokens in range(10):
        sched = SimpleNamespace(kind="prefill", num_batched_tokens=tokens, scheduled=[None])
        engine_module.Engine._log_slow_step(fake, sched, 1.0)
    assert len(fake._slow_shapes) == 3


def test_the_startup_line_names_every_cap(tiny_llava_dir):
    from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from mmserve.engine.cache_caps import caps_line
    from mmserve.engine.engine import Engine

    engine = Engine(
        EngineConfig(
            ModelConfig(tiny_llava_dir, device="cpu"),
            CacheConfig(encoder_cache_size=512, num_blocks=100, prompt_end_cache_size=32),
            SchedulerConfig(),
        )
    )
    line = caps_line(engine)
    row = engine.runner._hidden_size() * engine.dtype.itemsize
    assert (
        line.startswith("caches: encoder cache 512 rows, ")
        and f"{512 * row / 2**20:.1f} MiB on cpu" in line
    )
    for part in (
        "prefix-cache index <= 100 blocks",
        "prompt ends 32 prompts",
        "processed prompts 64 / 256.0 MiB",
        "image-processor outputs 16 / 128.0 MiB",
        "placeholder expansions 4096 image sizes",
        "compiled grammars 64",
        "LoRA adapters 8",
        "slow-step shapes 4096",
    ):
        assert part in line, (part, line)
