"""Memory-bandwidth roofline of a decode step: bytes of LM weights + KV cache read per step, divided by the
copy bandwidth of this device, measured in the same run with a large device-to-device tensor copy.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mmserve.bench.workload import now, sync, torch_dtype


@dataclass(frozen=True)
class LMShape:
    """Sizes of the language model that a decode step reads (the vision tower is not run in decode)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int

    @property
    def weight_bytes(self) -> int:
        """Every LM matrix is read once per step; of the embedding table only B rows (ignored)."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h  # q, k, v, o, gate/up/down, 2 norms
        return (self.layers * per_layer + h + self.vocab * h) * self.dtype_bytes  # + final norm + lm_head

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def lm_shape(model_dir: str, dtype: str) -> LMShape:
    """Read the text model's sizes from a llava-style (or plain decoder) config.json."""
    import torch

    cfg: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    return LMShape(hidden=hidden, intermediate=int(text["intermediate_size"]), layers=int(text["num_hidden_layers"]),
                   heads=heads, kv_heads=int(text.get("num_key_value_heads") or heads),
                   head_dim=int(text.get("head_dim") or hidden // heads), vocab=int(text["vocab_size"]),
                   dtype_bytes=torch.finfo(torch_dtype(dtype)).bits // 8)


def measure_copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> dict[str, float]:
    """Bytes moved (read + written) per second by `dst.copy_(src)` of `nbytes` on `device`."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm up (allocation, first-touch pages, clocks)
    sync(device)
    t0 = now()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    elapsed = now() - t0
    del src, dst
    return {"copy_bytes": nbytes, "iters": iters, "seconds": elapsed,
            "bytes_per_s": 2 * nbytes * iters / elapsed, "gb_per_s": 2 * nbytes * iters / elapsed / 1e9}


def decode_roofline(shape: LMShape, batch_size: int, context_len: float, bytes_per_s: float) -> dict[str, float]:
    """Best-case decode step when it is bound by memory traffic.

    Args:
        batch_size: sequences decoded together (one token each per step).
        context_len: mean tokens already in each sequence's KV cache during the step.
        bytes_per_s: measured device copy bandwidth.
    Returns:
        bytes_per_step (weights + KV), ms_per_step and tok_s at that bandwidth.
    """
    kv = batch_size * context_len * shape.kv_bytes_per_token
    total = shape.weight_bytes + kv
    seconds = total / bytes_per_s
    return {"weight_bytes": shape.weight_bytes, "kv_bytes": kv, "bytes_per_step": total,
            "ms_per_step": seconds * 1e3, "tok_s": batch_size / seconds}


def shape_record(shape: LMShape) -> dict[str, int]:
    return {**asdict(shape), "weight_bytes": shape.weight_bytes, "kv_bytes_per_token": shape.kv_bytes_per_token}
