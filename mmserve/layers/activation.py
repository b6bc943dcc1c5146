"""Activation functions by their Hugging Face config names, and the fused SiLU-and-mul of gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.fp8_linear import QuantizesRows


class SiluAndMul(QuantizesRows, nn.Module):
    """x = [gate | up] -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from mmserve.kernels.fused_ops import silu_and_mul

            return silu_and_mul(x, **self.quantize_args(x))
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # Persimmon / Fuyu
    "silu": F.silu,
}


def get_act_fn(name: str):
    if name not in _ACTS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTS)}")
    return _ACTS[name]
