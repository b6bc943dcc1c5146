"""Host -> device copies that never make the host wait for the GPU stream.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the
stream, which would stall the host behind the step already running on the GPU (async scheduling).
Staging through pinned memory from torch's caching host allocator (which keeps a block until its copy
has run) lets the copy be queued like a kernel.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or CPU tensor) as a tensor of `dtype` on `device`, queued without a host sync on CUDA."""
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def copy_into(dst: torch.Tensor, values: Sequence | torch.Tensor) -> None:
    """dst.copy_(values) from host data of dst's shape, queued without a host sync on CUDA."""
    t = values.to(dst.dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        t = t.pin_memory()
    dst.copy_(t.view(dst.shape), non_blocking=dst.is_cuda)
