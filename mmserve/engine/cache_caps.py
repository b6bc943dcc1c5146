"""The caches of an engine that fill with traffic, and their caps: `mmserve serve` logs them at startup in one INFO
line (`caps_line`); docs/performance.md "Caches and their caps" lists them with their sizes. Everything else that
grows with traffic is per request and leaves with it (the engine's and the servers' request maps), or is preallocated
at startup (the KV pool, the prompt-end rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmserve.engine import engine as engine_module
from mmserve.multimodal.placeholder_expansion import PlaceholderExpansion
from mmserve.multimodal.processors import InputProcessor

if TYPE_CHECKING:
    from mmserve.engine.engine import Engine

# host bytes per entry of the small indexes, measured with tracemalloc on CPython 3.11
PREFIX_INDEX_ENTRY_BYTES = 120  # a registered block's sha256 digest and its dict slot
PROMPT_END_INDEX_ENTRY_BYTES = 200  # a prompt digest -> slot node
EXPANSION_ENTRY_BYTES = 300  # (width, height, images) -> a packed run


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def cache_caps(engine: Engine) -> list[tuple[str, str]]:
    """(cache, its cap and the bytes it holds at the cap) for each cache of `engine` that fills with traffic."""
    runner, cache = engine.runner, engine.config.cache
    row_bytes = runner._hidden_size() * engine.dtype.itemsize  # encoder outputs at the LM's width
    preprocess = engine.inputs.device or "cpu"
    caps = [
        (
            "encoder cache",
            f"{cache.encoder_cache_size} rows, {_mib(cache.encoder_cache_size * row_bytes)} on "
            f"{runner.device}",
        ),
        (
            "prefix-cache index",
            f"<= {engine.kv.num_blocks} blocks, "
            f"{_mib(engine.kv.num_blocks * PREFIX_INDEX_ENTRY_BYTES)}",
        ),
    ]
    if engine.scheduler.prompt_ends is not None:
        slots = engine.scheduler.prompt_ends.num_slots
        caps.append(
            (
                "prompt ends",
                f"{slots} prompts, {_mib(slots * row_bytes)} on {runner.device} (allocated at "
                f"startup) + {_mib(slots * PROMPT_END_INDEX_ENTRY_BYTES)}",
            )
        )
    caps += [
        (
            "processed prompts",
            f"{InputProcessor.RECENT_INPUTS} / {_mib(InputProcessor.RECENT_INPUTS_BYTES)} on "
            f"{preprocess}",
        ),
        (
            "image-processor outputs",
            f"{InputProcessor.RECENT_IMAGES} / {_mib(InputProcessor.RECENT_IMAGES_BYTES)} "
            f"on {preprocess}",
        ),
    ]
    if engine.inputs._expansion is not None:
        caps.append(
            (
                "placeholder expansions",
                f"{PlaceholderExpansion.MAX_SIZES} image sizes, "
                f"{_mib(PlaceholderExpansion.MAX_SIZES * EXPANSION_ENTRY_BYTES)}",
            )
        )
    caps += [
        ("compiled grammars", f"{engine.grammars.capacity}"),
        ("LoRA adapters", f"{engine.lora.max_loras}"),
        ("slow-step shapes", f"{engine_module.SLOW_SHAPES_KEPT}"),
    ]
    return caps


def caps_line(engine: Engine) -> str:
    """One line: 'caches: name cap; ...'."""
    return "caches: " + "; ".join(f"{name} {cap}" for name, cap in cache_caps(engine))
