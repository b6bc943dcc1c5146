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
