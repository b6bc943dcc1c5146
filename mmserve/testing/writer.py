"""Shared pieces of the random-checkpoint writers in :mod:`mmserve.testing`.

Every family (llava, llava_next, llava_onevision, qwen2_vl, blip2) builds a list of parameter specs
``(name, shape, kind, std)`` from a meta-device transformers model and writes its checkpoint with
:func:`write_checkpoint`, which streams seeded random tensors into (sharded) safetensors files with
:func:`write_sharded_weights`, one tensor in RAM at a time, with a progress bar over the bytes written when
stderr is a terminal.
A tensor's values depend only on its canonical name and the seed, never on layout or write order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

DEFAULT_MAX_SHARD_BYTES = 4_000_000_000
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
LAYOUTS = ("hub", "transformers")
ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}

# (name, shape, kind, std): kind is "normal" (N(0, std)), "ones" or "zeros"
ParamSpec = tuple[str, tuple[int, ...], str, float]
SizesT = TypeVar("SizesT")
ConfigT = TypeVar("ConfigT", bound="PreTrainedConfig")


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple (padded vocabulary sizes)."""
    return -(-n // multiple) * multiple


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
    dtype_fn: Callable[[tuple[Any, ...]], torch.dtype] | None = None,
) -> None:
    """Write ``specs`` as ``model.safetensors`` or as numbered shards plus ``model.safetensors.index.json``.

    A spec is ``(name, shape, ...)``; ``key_fn(name)`` is its on-disk key, and tensors are written
    sorted by :func:`natural_key` of that key. ``make_fn(spec)`` builds a tensor; the default is
    :func:`make_tensor` of a ``(name, shape, kind, std)`` spec with ``seed`` and ``dtype``. ``dtype_fn(spec)``,
    when given, is a spec's own dtype (default ``dtype``).
    ``progress``: a bar over the bytes written on stderr, shown only when stderr is a terminal; the files
    written are the same either way.
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if make_fn is None:

        def make_fn(sp: tuple[Any, ...]) -> torch.Tensor:
            return make_tensor(*sp, seed, dtype)

    specs = sorted(specs, key=lambda sp: natural_key(key_fn(sp[0])))
    dtypes = [dtype_fn(sp) if dtype_fn is not None else dtype for sp in specs]
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


def meta_tensors(
    model_cls: type, config: PreTrainedConfig
) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is a norm's parameter) of every tensor in the state dict of ``model_cls(config)``,
    built on the meta device (no memory used)."""
    with torch.device("meta"):
        model = model_cls(config)
    norm_params = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm"):
            norm_params.update(f"{mod_name}.{p}" for p, _ in mod.named_parameters(recurse=False))
    return [(name, tuple(t.shape), name in norm_params) for name, t in model.state_dict().items()]


def param_specs(
    model_cls: type,
    config: PreTrainedConfig,
    std_of: Callable[[str], float],
    random_bias: Callable[[str], bool] = lambda name: False,
) -> list[ParamSpec]:
    """(name, shape, kind, std) of every saved tensor, from :func:`meta_tensors`.

    Norm scales are ones and norm shifts zeros; other biases are zeros unless ``random_bias(name)``;
    the rest is N(0, ``std_of(name)``). A tied ``lm_head.weight`` is not saved.
    """
    tied = getattr(config, "tie_word_embeddings", False)
    specs = []
    for name, shape, is_norm in meta_tensors(model_cls, config):
        if tied and name == "lm_head.weight":
            continue
        if is_norm:
            kind = "zeros" if name.endswith(".bias") else "ones"
        else:
            kind = "zeros" if name.endswith(".bias") and not random_bias(name) else "normal"
        specs.append((name, shape, kind, std_of(name)))
    return specs


def replace_sizes(
    presets: dict[str, SizesT], preset: str, family: str, overrides: dict[str, object]
) -> SizesT:
    """presets[preset] with dataclass-field overrides (lists become tuples); clear errors for unknown names."""
    if preset not in presets:
        raise ValueError(f"unknown {family} preset {preset!r}; known: {sorted(presets)}")
    base = presets[preset]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown {family} overrides {unknown}; allowed: {sorted(fields)}")
    overrides = {
        k: tuple(map(tuple, v)) if k == "grid_pinpoints" else tuple(v) if isinstance(v, list) else v
        for k, v in overrides.items()
    }
    return dataclasses.replace(base, **overrides)


def check_layout(layout: str) -> None:
    """Reject a ``layout`` other than "hub" (published repos' names) or "transformers" (save_pretrained's)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'hub' or 'transformers', got {layout!r}")


def check_token_ids(
    tok: PreTrainedTokenizerBase, expected: dict[str, int], tokens: dict[str, str], model_vocab: int
) -> None:
    """Assert the tokenizer's ids equal ``expected`` and fit the model vocab.

    Keys "unk", "bos", "eos", "pad" are read from the tokenizer's special tokens; any other key
    is the id of ``tokens[key]``.
    """
    specials = {
        "unk": tok.unk_token_id,
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
    }
    got = {
        k: specials[k] if k in specials else tok.convert_tokens_to_ids(tokens[k]) for k in expected
    }
    assert got == expected and len(tok) <= model_vocab, (got, expected, len(tok))


def finish_config(config: ConfigT, architecture: str, dtype: str) -> ConfigT:
    """Name the model class in ``config`` and set ``dtype`` on it and on each of its sub-configs."""
    config.architectures = [architecture]
    for c in (config, *(getattr(config, key) for key in config.sub_configs)):
        c.dtype = dtype
    return config


def write_checkpoint(
    out_dir: str | Path,
    config: PreTrainedConfig,
    processor: Any,
    image_processor: Any,
    specs: Sequence[tuple[Any, ...]],
    key_fn: Callable[[str], str],
    dtype: torch.dtype | str,
    seed: int,
    max_shard_bytes: int,
    make_fn: Callable[[tuple[Any, ...]], torch.Tensor] | None = None,
    progress: bool = True,
) -> Path:
    """Write a whole checkpoint into ``out_dir`` (created if missing) and return its path.

    Saved: the processor, the standalone image processor, the config, a GenerationConfig with the
    text model's special ids, and the weights of ``specs`` (see :func:`write_sharded_weights`).
    transformers 5 nests the image processor in processor_config.json; the standalone
    preprocessor_config.json is what published repos (and non-transformers loaders) have.
    ``progress``: a bar over the weight bytes on stderr when it is a terminal (see :func:`progress_bar`).
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()  # a rebuild with other sizes must not leave old shards behind
    processor.save_pretrained(out)
    image_processor.save_pretrained(out)
    config.save_pretrained(out)
    text = config.get_text_config()
    GenerationConfig(
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=text.eos_token_id,  # T5: no bos
        pad_token_id=text.pad_token_id,
    ).save_pretrained(out)
    write_sharded_weights(out, specs, key_fn, dtype, seed, max_shard_bytes, make_fn, progress)
    return out
