"""Normalisation layers: RMSNorm with an optional fused residual add (and, on GPUs, FP8 output for an FP8 linear);
ShardedLayerNorm, a LayerNorm over features that tensor parallelism splits across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from mmserve.layers.fp8_linear import QuantizesRows


class RMSNorm(QuantizesRows, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from mmserve.kernels.fused_ops import rms_norm

            quantize = self.quantize_args(x) if x.dtype == self.weight.dtype else {}
            return rms_norm(x, self.weight, self.eps, residual, **quantize)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ShardedLayerNorm(nn.Module):
    """LayerNorm over `hidden_size` features of which this rank holds a contiguous 1/tp slice (the output of a
    column-parallel layer, or of attention over this rank's heads), as Kosmos-2's sub-LayerNorms sit before a
    row-parallel projection. Mean and variance come from sums all-reduced over the ranks (two passes, as
    nn.LayerNorm computes them); weight and bias are sliced like the features. At TP=1 it is nn.LayerNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        tp = get_tp_size()
        if hidden_size % tp:
            raise ValueError(
                f"ShardedLayerNorm: {hidden_size} features do not split over {tp} ranks"
            )
        self.hidden_size, self.eps, self.local = hidden_size, eps, hidden_size // tp
        self.weight = nn.Parameter(torch.ones(self.local), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(self.local), requires_grad=False)
        for param in (self.weight, self.bias):
            param.weight_loader = self._load_slice

    def _load_slice(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded.shape != (self.hidden_size,):
            raise ValueError(
                f"weight shape {tuple(loaded.shape)} does not match LayerNorm({self.hidden_size})"
            )
        param.data.copy_(loaded.narrow(0, get_tp_rank() * self.local, self.local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.local == self.hidden_size:
            return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
        dtype = x.dtype
        x = x.float()
        mean = tp_all_reduce(x.sum(-1, keepdim=True)) / self.hidden_size
        x = x - mean
        var = tp_all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.hidden_size
        return (x * torch.rsqrt(var + self.eps) * self.weight.float() + self.bias.float()).to(dtype)
