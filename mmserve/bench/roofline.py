"""Memory-bandwidth roofline of a decode step: bytes of LM weights + KV cache read per step, divided by the
copy bandwidth of this device, measured in the same run with a large device-to-device tensor copy.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mmserve.bench.workload import now, sync, torch_dtype
from mmserve.models.family import TextShape


@dataclass(frozen=True)
class LMShape(TextShape):
    """The text model's sizes (`TextShape`, read by the module of its model type) with the bytes one GPU reads
    per element; the vision tower is not run in decode."""

    dtype_bytes: int = 2
    kv_dtype_bytes: int | None = (
        None  # bytes per cached K/V element when the cache is not in the model dtype
    )
    # bytes per decoder-layer matrix element when quantized (fp8, int8: 1; int4: 0.5; their per-row scales left out)
    linear_dtype_bytes: float | None = None
    tp: int = 1  # tensor-parallel ranks: each GPU reads 1/tp of the matrices and KV heads

    @property
    def weight_bytes(self) -> int:
        """Every LM matrix, bias and norm is read once per step; of the embedding tables only B rows (ignored)."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        norm = 2 * h if self.layer_norm else h
        matrices = h * q + 2 * h * kv + q * h + self.mlp_matrices * h * i  # q, k, v, o, MLP
        per_layer = 2 * norm + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
        per_layer += (
            ((self.mlp_matrices - 1) * i + h) if self.mlp_bias else 0
        )  # gate/up or fc1, down/fc2
        per_layer += 2 * self.head_dim * (2 if self.layer_norm else 1) if self.qk_norm else 0
        per_layer += 2 * (q + i) if self.sub_layer_norm else 0
        if self.cross_attention:
            matrices += 2 * h * q  # cross q, o
            per_layer += norm + (q if self.qkv_bias else 0) + (h if self.o_bias else 0)
        e = self.embed_dim or h
        head = (
            self.vocab * e + (2 * h * e if e != h else 0) + (norm if self.final_norm else 0)
        )  # lm_head, proj
        head += norm if self.embed_norm else 0
        selfs, cross = self.layers - self.cross_layers, self.cross_layers
        cross_matrices = 2 * h * q + self.mlp_matrices * h * i
        cross_per_layer = 2 * norm + 2 * self.head_dim + 2
        matrix_bytes = int(
            (selfs * matrices + cross * cross_matrices)
            * (self.linear_dtype_bytes or self.dtype_bytes)
        )
        return (
            selfs * per_layer + cross * cross_per_layer + head
        ) * self.dtype_bytes + matrix_bytes // self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        kv_heads = max(
            1, self.kv_heads // self.tp
        )  # per GPU (replicated when fewer heads than ranks)
        return (
            2
            * (self.layers - self.cross_layers)
            * kv_heads
            * self.head_dim
            * (self.kv_dtype_bytes or self.dtype_bytes)
        )


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config.json: its `text_config` (`llm_cfg` in VILA's layout), the `decoder` of
    a vision-encoder-decoder, else itself."""
    decoder = cfg.get("decoder")
    return (
        cfg.get("text_config")
        or cfg.get("llm_cfg")
        or (decoder if isinstance(decoder, dict) else None)
        or cfg
    )


# a nibble, and per group of 128 an fp16 scale and a uint8 zero point
_GROUP_INT4_BYTES = 0.5 + 3 / 128
_LINEAR_BYTES = {
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
    "int4_g128": _GROUP_INT4_BYTES,
    "w8a8": 1,
    "awq": _GROUP_INT4_BYTES,
    "gptq": _GROUP_INT4_BYTES,
}  # --quantization (or a checkpoint's method) -> stored bytes per matrix element


def lm_shape(
    model_dir: str,
    dtype: str,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
    tp: int = 1,
) -> LMShape:
    """Read the text model's sizes from a vision-language (or plain decoder) config.json; quantized decoder matrices
    count their stored bytes: one per element for FP8 (`quantization="fp8"`, or a checkpoint quantized to FP8),
    int8 and W8A8, half a byte for int4 (plus the group-wise scales and zero points of int4_g128 / AWQ / GPTQ). `tp`: the bytes one GPU of that many tensor-parallel ranks reads."""
    import torch

    from mmserve.config import CacheConfig
    from mmserve.models.quantization import checkpoint_quantization
    from mmserve.models.registry import text_shape

    file = Path(model_dir) / "config.json"
    if file.is_file():
        config = json.loads(file.read_text())
    else:  # a family's own layout (a NeVA's .nemo): its text config as the family reads it
        from mmserve.models.loader import load_hf_config, text_config_of

        config = text_config_of(load_hf_config(model_dir)).to_dict()
    model_dtype = torch_dtype(dtype)
    cache_dtype = CacheConfig(kv_cache_dtype=kv_cache_dtype).cache_dtype(model_dtype)
    return LMShape(
        **asdict(text_shape(text_config(config))),
        dtype_bytes=torch.finfo(model_dtype).bits // 8,
        kv_dtype_bytes=torch.finfo(cache_dtype).bits // 8,
        linear_dtype_bytes=_LINEAR_BYTES.get(quantization)
        or _LINEAR_BYTES.get(checkpoint_quantization(config.get("quantization_config"))),
        tp=tp,
    )


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
    return {
        "copy_bytes": nbytes,
        "iters": iters,
        "seconds": elapsed,
        "bytes_per_s": 2 * nbytes * iters / elapsed,
        "gb_per_s": 2 * nbytes * iters / elapsed / 1e9,
    }


def decode_roofline(
    shape: LMShape, batch_size: int, context_len: float, bytes_per_s: float
) -> dict[str, float]:
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
    return {
        "weight_bytes": shape.weight_bytes,
        "kv_bytes": kv,
        "bytes_per_step": total,
        "ms_per_step": seconds * 1e3,
        "tok_s": batch_size / seconds,
    }


def shape_record(shape: LMShape) -> dict[str, int]:
    return {
        **asdict(shape),
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
    }
