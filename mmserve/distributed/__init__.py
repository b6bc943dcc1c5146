"""Tensor-parallel state: rank and world size of this process (1 process = 1 GPU), and its collectives.

TP=1 needs none of it: every function here is the identity then. With `--tensor-parallel-size N` the engine's
process is rank 0 (the driver: scheduling, preprocessing, vision encoders, sampling) and N - 1 worker processes
(`worker/tp_workers.py`) hold the other shards of the language model; `layers/linear.py` shards by these numbers
and sums row-parallel outputs with `tp_all_reduce` (with `--mm-encoder-tp-mode data` the ranks also encode a step's pictures and gather them:
`tp_all_gather_varlen`). Collectives run over NCCL on CUDA and gloo on the CPU. With
`--nnodes` the ranks span machines (`distributed/launch.py`: who runs where, and where they meet).
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
TIMEOUT = timedelta(minutes=5)  # a collective stuck this long fails instead of hanging the server
SHUTDOWN_WAIT = timedelta(seconds=60)
logger = logging.getLogger(__name__)


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group as `rank` of `size` (blocks until every rank has joined)."""
    global _TP_RANK, _TP_SIZE
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    _TP_RANK, _TP_SIZE = rank, size


def tp_all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or `op` "max") x over the tensor-parallel group, in place (identity at TP=1)."""
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return x


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """x of rank 0 on every rank (in place; identity at TP=1)."""
    if _TP_SIZE > 1:
        dist.broadcast(x, src=0)
    return x


def tp_all_gather_varlen(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's 1-D `x` (lengths may differ; dtype and device the same on every rank), in rank order, on
    every rank: the lengths first (a host sync), then the tensors padded to the longest ([x] at TP=1)."""
    if _TP_SIZE == 1:
        return [x]
    sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(_TP_SIZE)]
    dist.all_gather(sizes, torch.tensor([x.numel()], dtype=torch.int64, device=x.device))
    lengths = [int(n) for n in torch.cat(sizes).tolist()]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=x.dtype, device=x.device)
    padded[: x.numel()] = x
    out = [torch.empty(longest, dtype=x.dtype, device=x.device) for _ in range(_TP_SIZE)]
    dist.all_gather(out, padded)
    return [t[:n] for t, n in zip(out, lengths)]


def shutdown_tensor_parallel(abort: bool = False) -> None:
    """Leave the group: destroy it (every rank at about the same time; on CUDA after this rank's graphs that
    captured collectives are gone), or abort it when a peer has died (NCCL only; gloo needs no peer to leave).
    A teardown still stuck after SHUTDOWN_WAIT is left behind with a warning rather than hanging the caller."""
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = 0, 1
    if not dist.is_initialized():
        return
    nccl = dist.get_backend() == "nccl"
    abort_group = getattr(
        dist.distributed_c10d, "_abort_process_group", None
    )  # NCCL only, PyTorch >= 2.6
    leave = (
        abort_group if abort and nccl and abort_group is not None else dist.destroy_process_group
    )
    thread = threading.Thread(target=leave, name="mmserve-tp-shutdown", daemon=True)
    thread.start()
    thread.join(SHUTDOWN_WAIT.total_seconds())
    if thread.is_alive():
        logger.warning(
            "the tensor-parallel process group did not shut down within %d s; leaving it",
            SHUTDOWN_WAIT.seconds,
        )
