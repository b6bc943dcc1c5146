"""Reading NeMo ``.nemo`` checkpoints (NeVA) without NeMo: the yaml, the weights and the tokenizer file.

A ``.nemo`` is a tar, plain or gzip (NeMo ``SaveRestoreConnector``; TensorRT-LLM's
``examples/gpt/utils/nemo.py:unpack_nemo_ckpt`` and ``multimodal_builder.build_neva_engine`` read it the same
way), or the directory it was extracted to. Members (with or without a leading ``./``):

- ``model_config.yaml``: the model section of the training config (``mm_cfg`` present for a NeVA);
- ``model_weights.ckpt`` (``torch.save`` of the flat Megatron-core state dict), or one per tensor-parallel rank
  in ``mp_rank_XX/model_weights.ckpt`` (merged here: column-parallel ``linear_qkv`` / ``linear_fc1`` by rows,
  gated ``linear_fc1`` per half, row-parallel ``linear_proj`` / ``linear_fc2`` by columns, the word embeddings
  and output layer by vocab rows, norms and the projector replicated);
- the tokenizer file the yaml names as ``tokenizer.model: nemo:<hash>_tokenizer.<ext>``.

Refused with a one-line ValueError: pipeline-parallel shards (``tp_rank_XX_pp_rank_YYY`` with several YYY) and
Megatron distributed checkpoints (a ``model_weights/`` directory with ``metadata.json``). Members are read one at
a time (a gzip member goes through one temporary file); nothing else is extracted. A tar's member list and its
yaml are kept per process by the file's path, size and mtime (a gzip tar is decompressed whole to be listed).
``torch.load`` runs with ``weights_only=True`` (``io.BytesIO`` allowed: Transformer Engine's ``_extra_state``,
which is skipped).
"""

from __future__ import annotations

import copy
import io
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import yaml

CONFIG_NAME = "model_config.yaml"
WEIGHTS_NAME = "model_weights.ckpt"
GATED_ACTIVATIONS = ("swiglu", "fast-swiglu", "geglu", "fast-geglu", "reglu", "fast-reglu")
# module-name suffixes by tensor-parallel split: MCore names, then the legacy NeMo names
COLUMN_PARALLEL = (".linear_qkv", ".linear_fc1", ".query_key_value", ".dense_h_to_4h")
ROW_PARALLEL = (".linear_proj", ".linear_fc2", ".self_attention.dense", ".dense_4h_to_h")
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")
SUPPORTED = (
    f"supported: ./{WEIGHTS_NAME} or tensor-parallel ./mp_rank_XX/{WEIGHTS_NAME} shards (merged)"
)
DIST_CKPT_HINT = (
    "convert it to one file first: extract the .nemo and run `python -m "
    "torch.distributed.checkpoint.format_utils dcp_to_torch model_weights model_weights.ckpt` in it, "
    "then remove model_weights/ and re-tar"
)


# By a tar's identity (path, size, mtime): its members, and its model_config.yaml parsed. Listing a gzip tar's
# members decompresses the whole file, and loading a NeVA reads the archive six times (config, tokenizer, weights,
# vision tower, processor): with these, a gzip .nemo is decompressed once to list it, not once per read.
_MEMBERS: dict[tuple[str, int, int], dict[str, tarfile.TarInfo]] = {}
_CONFIGS: dict[tuple[str, int, int], dict[str, Any]] = {}


def _norm(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name.lstrip("/")


class _Archive:
    """The members of a ``.nemo`` tar (plain or gzip) or of its extracted directory, by normalized name."""

    def __init__(self, path: str | Path) -> None:
        self.path = _resolve(path)
        self.tar: tarfile.TarFile | None = None
        self.key: tuple[str, int, int] | None = None  # a tar's identity (_MEMBERS, _CONFIGS)
        if self.path.is_dir():
            self.members: dict[str, Any] = {
                _norm(p.relative_to(self.path).as_posix()): p
                for p in self.path.rglob("*")
                if p.is_file()
            }
            return
        if not self.path.is_file():
            raise ValueError(f"{self.path}: no such .nemo file or directory")
        try:
            self.tar = tarfile.open(self.path, "r:*")
        except tarfile.ReadError as e:
            raise ValueError(f"{self.path} is not a .nemo archive (tar, plain or gzip): {e}") from e
        stat = self.path.stat()
        self.key = (str(self.path), stat.st_size, stat.st_mtime_ns)
        if self.key not in _MEMBERS:
            _MEMBERS[self.key] = {_norm(m.name): m for m in self.tar.getmembers() if m.isfile()}
        self.members = _MEMBERS[self.key]
        self.compressed = not isinstance(self.tar.fileobj, io.BufferedReader)  # gzip, bz2, xz

    def __enter__(self) -> _Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tar is not None:
            self.tar.close()

    def open(self, name: str) -> BinaryIO:
        member = self.members[name]
        if self.tar is None:
            return open(member, "rb")
        f = self.tar.extractfile(member)
        assert f is not None
        return f

    def load(self, name: str) -> dict[str, Any]:
        """torch.load of one member: memory-mapped from a directory, streamed from a plain tar, through one
        temporary file from a gzip one (its stream cannot seek cheaply)."""
        with torch.serialization.safe_globals([io.BytesIO, bytes]):
            if self.tar is None:
                return torch.load(
                    self.members[name], map_location="cpu", weights_only=True, mmap=True
                )
            if not self.compressed:
                with self.open(name) as f:
                    return torch.load(f, map_location="cpu", weights_only=True)
            fd, tmp = tempfile.mkstemp(suffix=".ckpt")
            try:
                with os.fdopen(fd, "wb") as out, self.open(name) as f:
                    shutil.copyfileobj(f, out, 1 << 24)
                return torch.load(tmp, map_location="cpu", weights_only=True, mmap=True)
            finally:
                os.unlink(tmp)  # a memory map keeps the data readable


def _resolve(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir() and not (p / CONFIG_NAME).is_file():
        found = sorted(p.glob("*.nemo"))
        if len(found) == 1:
            return found[0]
    return p


def nemo_file(model_dir: str | Path) -> Path:
    """The checkpoint of ``model_dir``: a ``.nemo`` file itself, an extracted one (a directory holding
    model_config.yaml), or the one ``*.nemo`` in a directory (every function here accepts such a directory);
    ValueError otherwise."""
    p = _resolve(model_dir)
    if not (p.is_file() or (p / CONFIG_NAME).is_file()):
        raise ValueError(
            f"{p}: expected a .nemo file, an extracted .nemo or a directory with one .nemo"
        )
    return p


def _yaml(archive: _Archive) -> dict[str, Any]:
    """model_config.yaml parsed (a copy: callers may change it)."""
    if archive.key in _CONFIGS:
        return copy.deepcopy(_CONFIGS[archive.key])
    if CONFIG_NAME not in archive.members:
        raise ValueError(f"{archive.path}: no {CONFIG_NAME} in the .nemo archive")
    with archive.open(CONFIG_NAME) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{archive.path}: {CONFIG_NAME} is not a mapping")
    if archive.key is not None:
        _CONFIGS[archive.key] = copy.deepcopy(cfg)
    return cfg


def read_nemo_config(path: str | Path, require_neva: bool = True) -> dict[str, Any]:
    """model_config.yaml of the ``.nemo`` at ``path``, parsed; a ValueError naming the file when it is missing, or,
    with ``require_neva``, when it is not a NeVA's (no ``mm_cfg``)."""
    with _Archive(path) as archive:
        cfg = _yaml(archive)
    if require_neva and not isinstance(cfg.get("mm_cfg"), dict):
        raise ValueError(
            f"{path}: {CONFIG_NAME} has no mm_cfg; not a NeVA checkpoint (only NeVA .nemo files are supported)"
        )
    return cfg


def _shard_names(archive: _Archive) -> list[str]:
    """The weight members to merge, in rank order; ValueError for layouts not supported."""
    names = archive.members
    if any(n.startswith("model_weights/") for n in names):
        raise ValueError(
            f"{archive.path}: holds a Megatron distributed checkpoint (model_weights/ with metadata.json), "
            f"not supported; {DIST_CKPT_HINT}"
        )
    if WEIGHTS_NAME in names:
        return [WEIGHTS_NAME]
    tp = sorted(n for n in names if re.fullmatch(rf"mp_rank_\d+/{WEIGHTS_NAME}", n))
    tp_pp = sorted(n for n in names if re.fullmatch(rf"tp_rank_\d+_pp_rank_\d+/{WEIGHTS_NAME}", n))
    if tp_pp:
        if any(not n.split("/")[0].endswith("_pp_rank_000") for n in tp_pp):
            raise ValueError(
                f"{archive.path}: pipeline-parallel shards (tp_rank_XX_pp_rank_YYY) are not supported; "
                f"{SUPPORTED}"
            )
        tp = tp_pp
    if not tp:
        raise ValueError(f"{archive.path}: no {WEIGHTS_NAME} in the .nemo archive ({SUPPORTED})")
    ranks = [int(re.search(r"\d+", n).group()) for n in tp]
    if ranks != list(range(len(tp))):
        raise ValueError(
            f"{archive.path}: tensor-parallel shards {tp} are not ranks 0..{len(tp) - 1}"
        )
    return tp


def _state_dict(obj: Any, path: Path, name: str) -> dict[str, Any]:
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {name} is not a state dict")
    return obj


def _is_replicated(name: str) -> bool:
    module, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    return leaf.startswith("layer_norm_") or "norm" in module.rsplit(".", 1)[-1]


def merge_tp_shards(name: str, parts: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """One tensor of the full model from its tensor-parallel shards (rank order), by Megatron's split of
    ``name``; ``gated``: the MLP is GLU (each rank's linear_fc1 holds [gate_r; up_r]). ValueError when the rule is
    unknown and the shards differ."""
    if len(parts) == 1:
        return parts[0]
    module, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    if _is_replicated(name):
        return parts[0]
    if module.endswith(COLUMN_PARALLEL) and leaf in ("weight", "bias"):
        if gated and module.endswith((".linear_fc1", ".dense_h_to_4h")):
            halves = [p.chunk(2, dim=0) for p in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(parts, dim=0)
    if module.endswith(ROW_PARALLEL) and leaf in ("weight", "bias"):
        return torch.cat(parts, dim=1) if leaf == "weight" else parts[0]
    if name.endswith(VOCAB_PARALLEL):
        return torch.cat(parts, dim=0)
    if all(p.shape == parts[0].shape and torch.equal(p, parts[0]) for p in parts[1:]):
        return parts[0]
    raise ValueError(
        f"cannot merge the tensor-parallel shards of {name!r} (no split rule, shards differ); {SUPPORTED}"
    )


def iter_nemo_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of the ``.nemo`` at ``path`` in the file's order, MCore (or legacy) names
    as stored; tensor-parallel shards merged to the full model. ``_extra_state`` entries and other non-tensors are
    skipped. ValueError naming the file for a missing model_config.yaml / weights or an unsupported layout."""
    with _Archive(path) as archive:
        cfg = _yaml(archive)
        gated = str(cfg.get("activation", "")).lower() in GATED_ACTIVATIONS
        names = _shard_names(archive)
        shards = [_state_dict(archive.load(n), archive.path, n) for n in names]
    for key, value in shards[0].items():
        if key.endswith("_extra_state") or not isinstance(value, torch.Tensor):
            continue
        missing = [n for n, s in zip(names, shards) if not isinstance(s.get(key), torch.Tensor)]
        if missing:
            raise ValueError(f"{path}: tensor {key!r} missing from {missing}")
        yield key, merge_tp_shards(key, [s[key] for s in shards], gated)


def nemo_tokenizer_file(path: str | Path, out_dir: str | Path, key: str = "model") -> Path:
    """Extract the tokenizer file the yaml names as ``tokenizer.<key>: nemo:<name>`` into ``out_dir`` and return
    its path; ValueError naming the archive when the yaml names none or the member is missing."""
    with _Archive(path) as archive:
        cfg = _yaml(archive)
        ref = (cfg.get("tokenizer") or {}).get(key)
        if not isinstance(ref, str) or not ref.startswith("nemo:"):
            raise ValueError(
                f"{path}: {CONFIG_NAME} tokenizer.{key} is {ref!r}, not a nemo:<file> member"
            )
        name = _norm(ref[len("nemo:") :])
        if name not in archive.members:
            raise ValueError(
                f"{path}: tokenizer file {name!r} (tokenizer.{key}) is not in the archive"
            )
        out = Path(out_dir) / Path(name).name
        out.parent.mkdir(parents=True, exist_ok=True)
        with archive.open(name) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def vision_tower_dir(path: str | Path, cfg: dict[str, Any] | None = None) -> Path:
    """The HF folder of the vision tower, as ``build_neva_engine`` finds it: ``mm_cfg.vision_encoder.
    from_pretrained``'s basename next to the ``.nemo``, else that path itself; ValueError when neither is a
    directory (hub names are not fetched)."""
    path = _resolve(path)
    cfg = cfg if cfg is not None else read_nemo_config(path)
    name = str(cfg["mm_cfg"]["vision_encoder"].get("from_pretrained") or "")
    here = path.parent / os.path.basename(name.rstrip("/"))
    for candidate in (here, Path(name)):
        if name and candidate.is_dir():
            return candidate
    raise ValueError(
        f"{path}: vision tower {name!r} (mm_cfg.vision_encoder.from_pretrained) not found"
    )
