"""Tiny random Hugging Face checkpoints, test images and the embedded demo model, all built offline.

Tests and benchmarks use these instead of a model hub; transformers loads every checkpoint written here.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path

from mmserve.testing.images import image_to_data_uri, image_to_png_bytes, make_test_image
from mmserve.testing.llava import checkpoint_key, llava_config, llava_sizes, make_llava_checkpoint
from mmserve.testing.tokenizer import build_bpe_tokenizer

__all__ = [
    "FAMILIES",
    "build_bpe_tokenizer",
    "checkpoint_key",
    "default_model_dir",
    "image_to_data_uri",
    "image_to_png_bytes",
    "llava_config",
    "llava_sizes",
    "make_checkpoint",
    "make_llava_checkpoint",
    "make_test_image",
]

# family -> "module:function" writing a tiny (or preset-sized) random checkpoint of that family
FAMILIES: dict[str, str] = {
    "llava": "mmserve.testing.llava:make_llava_checkpoint",
    "llava_next": "mmserve.testing.llava_next:make_llava_next_checkpoint",
    "llava_onevision": "mmserve.testing.llava_onevision:make_llava_onevision_checkpoint",
    "qwen2_vl": "mmserve.testing.qwen2_vl:make_qwen2_vl_checkpoint",
    "blip2": "mmserve.testing.blip2:make_blip2_checkpoint",
    "mllama": "mmserve.testing.mllama:make_mllama_checkpoint",
    "fuyu": "mmserve.testing.fuyu:make_fuyu_checkpoint",
    "kosmos2": "mmserve.testing.kosmos2:make_kosmos2_checkpoint",
    "nougat": "mmserve.testing.nougat:make_nougat_checkpoint",
    "pix2struct": "mmserve.testing.pix2struct:make_pix2struct_checkpoint",
    "pixtral": "mmserve.testing.pixtral:make_pixtral_checkpoint",
}

DEMO_SUBDIR = "demo-llava-v1"  # bump the suffix when the tiny recipe changes


def make_checkpoint(family: str, out_dir: str | Path, **kw: object) -> Path:
    """Write a random checkpoint of ``family`` (a key of :data:`FAMILIES`) into ``out_dir``."""
    try:
        maker = FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown model family {family!r}; known families: {', '.join(sorted(FAMILIES))}"
        ) from None
    module, name = maker.split(":")
    return getattr(importlib.import_module(module), name)(out_dir, **kw)


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
