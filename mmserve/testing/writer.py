"""Writing a random checkpoint to disk: seeded tensors streamed into (sharded) safetensors files.

:func:`write_checkpoint` saves a family's processor, config, generation config and weights;
:func:`write_sharded_weights` streams the tensors of a list of specs into ``model.safetensors`` or numbered
shards, one tensor in RAM at a time, with a progress bar over the bytes written when stderr is a terminal.
A tensor's values depend only on its canonical name and the seed (:func:`make_tensor`), never on layout or
write order. How a family lists its specs is :mod:`mmserve.testing.recipe`'s part.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

DEFAULT_MAX_SHARD_BYTES = 4_000_000_000
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


def natural_key(name: str) -> list[object]:
    """Sort key ordering embedded numbers numerically ("layers.2" before "layers.10")."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def make_tensor(
    name: str, shape: tuple[int, ...], kind: str, std: float, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """The tensor of one spec: ones, zeros, or N(0, std) seeded by ``seed`` and the tensor's name."""
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    # Seeded per tensor (by its canonical name), so values do not depend on layout or write order. Large
    # tensors of real-shape presets are drawn on the GPU when there is one (a 7B checkpoint in seconds
    # instead of a minute); their values then differ from a CPU machine's, which benchmarks do not mind.
    device = "cuda" if math.prod(shape) >= 1 << 22 and torch.cuda.is_available() else "cpu"
    g = torch.Generator(device).manual_seed(
        (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
    )
    return (
        (torch.randn(shape, generator=g, dtype=torch.float32, device=device) * std).to(dtype).cpu()
    )


def noisy(
    name: str, shape: tuple[int, ...], base: float, std: float, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """``base`` + N(0, ``std``) seeded as :func:`make_tensor` (norm scales around 1, shifts around 0), drawn and
    shifted in float32 and cast once."""
    return (make_tensor(name, shape, "normal", std, seed, torch.float32) + base).to(dtype)


def write_safetensors(
    path: Path,
    entries: list[tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], torch.dtype]],
    dtype: torch.dtype,
    make: Callable[[int], torch.Tensor],
    on_written: Callable[[int], object] | None = None,
) -> None:
    """Stream tensors into one safetensors file: header from shapes first, then one tensor in RAM at a time.

    An entry is (key, shape) in ``dtype``, or (key, shape, its own dtype) (e.g. an int64 index buffer among float
    weights). ``on_written(nbytes)`` is called after each tensor's data is written (progress reporting).
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape, *own in entries:
        dt = own[0] if own else dtype
        nbytes = torch.empty((), dtype=dt).element_size() * int(torch.Size(shape).numel())
        header[key] = {
            "dtype": ST_DTYPES[dt],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for i in range(len(entries)):
            t = make(i).contiguous()
            data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            f.write(data)
            if on_written is not None:
                on_written(len(data))


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Split item indices, in order, into shards of at most ``max_bytes`` (an oversized item gets its own)."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def progress_bar(total_bytes: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar on stderr over ``total_bytes``, or None when ``enabled`` is False or stderr is not a terminal
    (logs and pipes get no carriage-return noise)."""
    stream = sys.stderr
    if not enabled or stream is None or not getattr(stream, "isatty", lambda: False)():
        return None
    from tqdm import tqdm

    return tqdm(
        total=total_bytes,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=stream,
        dynamic_ncols=True,
    )


def write_sharded_weights(
    out_dir: Path,
    specs: Sequence[tuple[Any, ...]],
    key_fn: Callable[[str], str],
    dtype: torch.dtype | str,
    seed: int,
    max_shard_bytes: int,
    make_fn: Callable[[tuple[Any, ...]], torch.Tensor] | None = None,
    progress: bool = True,
    dtype_fn: Callable[[tuple[Any, ...]], torch.dtype | None] | None = None,
) -> None:
    """Write ``specs`` as ``model.safetensors`` or as numbered shards plus ``model.safetensors.index.json``.

    A spec is ``(name, shape, ...)``; ``key_fn(name)`` is its on-disk key, and tensors are written
    sorted by :func:`natural_key` of that key. ``make_fn(spec)`` builds a tensor; the default is
    :func:`make_tensor` of a ``(name, shape, kind, std)`` spec with ``seed`` and ``dtype``. ``dtype_fn(spec)``,
    when given, is a spec's own dtype, or None for ``dtype``.
    ``progress``: a bar over the bytes written on stderr, shown only when stderr is a terminal; the files
    written are the same either way.
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if make_fn is None:

        def make_fn(sp: tuple[Any, ...]) -> torch.Tensor:
            return make_tensor(*sp, seed, dtype)

    specs = sorted(specs, key=lambda sp: natural_key(key_fn(sp[0])))
    own = [None if dtype_fn is None else dtype_fn(sp) for sp in specs]
    dtypes = [dtype if dt is None else dt for dt in own]
    nbytes = [
        torch.empty((), dtype=dt).element_size() * math.prod(sp[1]) for sp, dt in zip(specs, dtypes)
    ]
    shards = plan_shards(nbytes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    bar = progress_bar(sum(nbytes), progress, f"writing {Path(out_dir).name or out_dir}")
    try:
        for k, idx in enumerate(shards):
            fname = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            entries = [(key_fn(specs[i][0]), specs[i][1], dtypes[i]) for i in idx]
            if bar is not None:
                bar.set_postfix_str(fname, refresh=False)
            write_safetensors(
                out_dir / fname,
                entries,
                dtype,
                lambda j, idx=idx: make_fn(specs[idx[j]]),
                None if bar is None else bar.update,
            )
            weight_map.update({key: fname for key, _, _ in entries})
    finally:
        if bar is not None:
            bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes)}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )


def write_checkpoint(
    out_dir: str | Path,
    config: PreTrainedConfig,
    processor: Any,
    specs: Sequence[tuple[Any, ...]],
    key_fn: Callable[[str], str],
    seed: int,
    max_shard_bytes: int,
    *,
    make_fn: Callable[[tuple[Any, ...]], torch.Tensor] | None = None,
    dtype_fn: Callable[[tuple[Any, ...]], torch.dtype | None] | None = None,
    generation: dict[str, int | None] | None = None,
    progress: bool = True,
) -> Path:
    """Write a whole checkpoint into ``out_dir`` (created if missing) and return its path.

    Saved: the processor, its image processor on its own, the config, a GenerationConfig of `generation`'s
    special ids (default: the text config's bos, eos and pad; written as given, not as the installed transformers
    would derive them), and the weights of ``specs`` in the config's dtype (see :func:`write_sharded_weights` for
    ``make_fn`` and ``dtype_fn``). transformers 5 nests the image processor in processor_config.json; the
    standalone preprocessor_config.json is what published repos (and non-transformers loaders) have.
    ``progress``: a bar over the weight bytes on stderr when it is a terminal (see :func:`progress_bar`).
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()  # a rebuild with other sizes must not leave old shards behind
    processor.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    config.save_pretrained(out)
    if generation is None:
        text = config.get_text_config()
        generation = {
            "bos_token_id": getattr(text, "bos_token_id", None),
            "eos_token_id": text.eos_token_id,
            "pad_token_id": text.pad_token_id,
        }
    GenerationConfig(**generation).save_pretrained(out)
    write_sharded_weights(
        out, specs, key_fn, config.dtype, seed, max_shard_bytes, make_fn, progress, dtype_fn
    )
    return out
