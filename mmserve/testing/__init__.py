"""Tiny random Hugging Face checkpoints, test images and the embedded demo model, all built offline.

Tests and benchmarks use these instead of a model hub; transformers loads every checkpoint written here.

A family's checkpoint writer lives in its own module of this package, which names the families it writes in a
module-level ``CHECKPOINT_WRITERS = {"family": make_family_checkpoint}``. :data:`FAMILIES` is found from those
on first use (every module of the package imported once), so a new family needs no line here. Its first key is
the demo model's family, the others follow by name. The same module may declare what the shared tests need
to know of those families, ``TEST_CASES = {"family": FamilyCase(...)}`` (:mod:`mmserve.testing.cases`), which
:func:`family_cases` collects.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserve.testing.cases import FamilyCase
from mmserve.testing.images import image_to_data_uri, image_to_png_bytes, make_test_image
from mmserve.testing.llava import checkpoint_key, llava_config, llava_sizes, make_llava_checkpoint
from mmserve.testing.tokenizer import build_bpe_tokenizer

__all__ = [
    "FAMILIES",
    "FamilyCase",
    "build_bpe_tokenizer",
    "checkpoint_key",
    "checkpoint_writers",
    "default_model_dir",
    "family_cases",
    "image_to_data_uri",
    "image_to_png_bytes",
    "llava_config",
    "llava_sizes",
    "make_checkpoint",
    "make_llava_checkpoint",
    "make_test_image",
]

DEMO_FAMILY = "llava"  # the embedded demo model's: FAMILIES' first key
DEMO_SUBDIR = "demo-llava-v1"  # bump the suffix when the tiny recipe changes

_WRITERS: dict[str, Callable[..., Path]] = {}
_CASES: dict[str, FamilyCase] = {}
if TYPE_CHECKING:
    FAMILIES: dict[
        str, str
    ]  # family -> "module:function" of its checkpoint writer (module __getattr__)


def checkpoint_writers() -> dict[str, Callable[..., Path]]:
    """family -> the function writing a tiny (or preset-sized) random checkpoint of it: the demo model's family
    first, then by name.

    Every module of this package is imported once and its ``CHECKPOINT_WRITERS`` read; a family named by two
    modules is an error.
    """
    if not _WRITERS:
        found: dict[str, Callable[..., Path]] = {}
        for _, family, writer in _declared("CHECKPOINT_WRITERS"):
            if family in found:
                raise ValueError(
                    f"model family {family!r} has two checkpoint writers: "
                    f"{_path(found[family])} and {_path(writer)}"
                )
            found[family] = writer
        _WRITERS.update(sorted(found.items(), key=lambda item: (item[0] != DEMO_FAMILY, item[0])))
    return _WRITERS


def family_cases() -> dict[str, FamilyCase]:
    """family -> what the shared tests need to know of it, from the ``TEST_CASES`` of the module that writes it, in
    :func:`checkpoint_writers`' order; families without one are left out.

    A case declared by a module that does not write the family is an error.
    """
    if not _CASES:
        writers = checkpoint_writers()
        found: dict[str, FamilyCase] = {}
        for module, family, case in _declared("TEST_CASES"):
            writer = writers.get(family)
            if writer is None or writer.__module__ != module:
                raise ValueError(
                    f"{module} declares a test case of model family {family!r}, written by "
                    f"{_path(writer) if writer else 'no module'}"
                )
            found[family] = case
        _CASES.update((family, found[family]) for family in writers if family in found)
    return _CASES


def _declared(attr: str) -> Iterator[tuple[str, str, Any]]:
    """(module, family, value) of every module's ``attr`` dict, every module of this package imported once."""
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for family, value in getattr(module, attr, {}).items():
            yield module.__name__, family, value


def _path(writer: Callable[..., Path]) -> str:
    return f"{writer.__module__}:{writer.__qualname__}"


def __getattr__(name: str) -> object:
    # FAMILIES: family -> "module:function" of its checkpoint writer, found on first use
    if name == "FAMILIES":
        families = {family: _path(writer) for family, writer in checkpoint_writers().items()}
        globals()["FAMILIES"] = families
        return families
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_checkpoint(family: str, out_dir: str | Path, **kw: object) -> Path:
    """Write a random checkpoint of ``family`` (a key of :data:`FAMILIES`) into ``out_dir``."""
    writers = checkpoint_writers()
    if family not in writers:
        raise ValueError(
            f"unknown model family {family!r}; known families: {', '.join(sorted(writers))}"
        )
    return writers[family](out_dir, **kw)


def default_model_dir() -> Path:
    """The embedded demo model (tiny llava), built on first use under ``$MMSERVE_HOME`` or ``~/.cache/mmserve``.

    It is built in a temporary sibling directory and renamed into place, so concurrent processes
    never see a half-written checkpoint; the loser of a race discards its copy.
    """
    home = Path(os.environ.get("MMSERVE_HOME") or Path.home() / ".cache" / "mmserve")
    target = home / DEMO_SUBDIR
    if (target / "config.json").is_file():
        return target
    home.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_SUBDIR}-", dir=home))
    try:
        make_llava_checkpoint(tmp, preset="tiny")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
