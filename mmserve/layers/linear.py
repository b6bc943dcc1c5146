"""Linear layers that know how they shard under tensor parallelism and how to load their weights.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)`; packed layers (QKV,
gate+up) accept their checkpoint parts by shard id.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.distributed import get_tp_rank, get_tp_size, tp_all_reduce


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a single fp16/bf16 row on CUDA (batch-1 decode) may go to the Triton GEMV instead."""
    if x.is_cuda and x.numel() == x.shape[-1] and x.dtype in (torch.float16, torch.bfloat16) \
            and weight.dtype == x.dtype and weight.stride(-1) == 1:
        from mmserve.kernels.gemv import linear_one_row
        return linear_one_row(x, weight, bias)
    return F.linear(x, weight, bias)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(_Linear):
    """Full weight on every rank."""


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_size()
        assert out_features % tp == 0, f"{out_features} output features do not split over TP={tp}"
        super().__init__(in_features, out_features // tp, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        size = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, get_tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate_proj + up_proj); shard_id = index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        tp = get_tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        part = loaded.narrow(0, get_tp_rank() * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; shard_id in {"q", "k", "v"}."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)   # KV heads are replicated when fewer than ranks
        self._kv_replicas = max(1, tp // num_kv_heads)
        out = (num_heads + 2 * num_kv_heads * self._kv_replicas) * head_dim
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = get_tp_rank() if shard_id == "q" else get_tp_rank() // self._kv_replicas
        part = loaded.narrow(0, rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), part)


class RowParallelLinear(_Linear):
    """Input features split across ranks; outputs summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_size()
        assert in_features % tp == 0, f"{in_features} input features do not split over TP={tp}"
        super().__init__(in_features // tp, out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:   # bias: full on every rank, added once after the reduce
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, get_tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
