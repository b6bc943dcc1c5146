"""What a written checkpoint holds on disk: its tensors by name and a digest of its safetensors files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open


def file_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory's safetensors files, by name."""
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def files_digest(d: Path) -> str:
    """sha256 of the safetensors files' bytes, in name order (same seed and sizes -> same digest)."""
    h = hashlib.sha256()
    for f in sorted(Path(d).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def load_matching_the_file(model_cls: type, d: Path, key_fn, absent: tuple[str, ...] = ()):
    """transformers loads ``d`` with no missing or unexpected key, and every tensor of its state but ``absent``
    (e.g. a tied head, not on disk) equals the file's, whose name is ``key_fn(name)``. Returns (model, its state,
    the file's tensors)."""
    model, info = model_cls.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info
    on_disk, state = file_tensors(d), model.state_dict()
    for name, value in state.items():
        if name not in absent:
            assert torch.equal(on_disk[key_fn(name)], value), name
    return model, state, on_disk
