"""Which attention backend a runner's layers use: Triton kernels on CUDA, plain torch elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.kernels.fp8_format import is_fp8


def select_backend(
    name: str, device: torch.device, attn_layers: list[nn.Module], kv_dtype: torch.dtype
) -> str:
    """Set the backend of `attn_layers` ("auto": triton on CUDA, torch elsewhere) and return its name;
    ValueError when the GPU cannot hold an FP8 KV cache with it."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from mmserve.attention import triton_backend

        for layer in attn_layers:
            layer.backend = triton_backend
    # Triton converts to/from e4m3 with the hardware instructions of Ada / Hopper and newer
    if is_fp8(kv_dtype) and device.type == "cuda" and name == "triton":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ValueError(
                f"kv_cache_dtype fp8 needs a GPU of compute capability >= 8.9 with the triton "
                f"attention backend; {torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}"
            )
    return name
