"""Tensor-parallel state: rank and world size of this process (1 process = 1 GPU).

Only TP=1 runs today; layers and loaders already shard by these numbers so TP>1 needs the
process launch and the all-reduce, not a rewrite of the models.
"""
from __future__ import annotations

import torch

_TP_RANK = 0
_TP_SIZE = 1


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel group (identity at TP=1)."""
    if _TP_SIZE == 1:
        return x
    torch.distributed.all_reduce(x)
    return x
