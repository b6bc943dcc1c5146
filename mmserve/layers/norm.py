"""Normalisation layers: RMSNorm with an optional fused residual add (and, on GPUs, FP8 output for an FP8 linear)."""
from __future__ import annotations

import torch
from torch import nn

from mmserve.layers.fp8_linear import QuantizesForFP8


class RMSNorm(QuantizesForFP8, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from mmserve.kernels.fused_ops import rms_norm
            consumer = self.fp8_consumer(x) if x.dtype == self.weight.dtype else None
            if consumer is not None:
                return rms_norm(x, self.weight, self.eps, residual, quantize=True, input_scale=consumer.input_scale)
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
