"""Tensor-parallel state: rank and world size of this process (1 process = 1 GPU), and its collectives.

TP=1 needs none of it: every function here is the identity then. With `--tensor-parallel-size N` the engine's
process is rank 0 (the driver: scheduling, preprocessing, vision encoders, sampling) and N - 1 worker processes
(`distributed/workers.py`) hold the other shards of the language model; `layers/linear.py` shards by these numbers
and sums row-parallel outputs with `tp_all_reduce`. Collectives run over NCCL on CUDA and gloo on the CPU.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
TIMEOUT = timedelta(minutes=5)   # a collective stuck this long fails instead of hanging the server


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group as `rank` of `size` (blocks until every rank has joined)."""
    global _TP_RANK, _TP_SIZE
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=size, timeout=TIMEOUT, device_id=device if device.type == "cuda" else None)
    _TP_RANK, _TP_SIZE = rank, size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel group (identity at TP=1)."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """x of rank 0 on every rank (in place; identity at TP=1)."""
    if _TP_SIZE > 1:
        dist.broadcast(x, src=0)
    return x


def shutdown_tensor_parallel() -> None:
    global _TP_RANK, _TP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE = 0, 1
