"""A worker node of multi-node tensor parallelism: `mmserve serve MODEL --tensor-parallel-size T --nnodes N
--node-rank R --dist-init-addr HOST:PORT` with R > 0 runs headless (no HTTP or gRPC server, no scheduler).

It starts one process per local GPU, the global ranks R*k .. R*k+k-1 (k = T / N, `distributed/launch.py`), each a
`worker_main` whose messages come from the driver over torch.distributed (`worker/tp_control.py`), and waits for
them. It exits 0 when the driver stops the group (node 0 shut down), and non-zero, with a log line, when the
driver is lost, the rendezvous times out or one of its ranks fails; then its other ranks are stopped too, so the
node goes as one.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal

import torch

from mmserve.config import EngineConfig, resolve_device
from mmserve.core.logs import current_logging
from mmserve.distributed import TIMEOUT
from mmserve.distributed.launch import NodeLayout
from mmserve.worker.tp_control import DriverLost
from mmserve.worker.tp_workers import check_tensor_parallel, worker_main

logger = logging.getLogger(__name__)


def node_rank_main(
    rank: int, config: EngineConfig, device_type: str, log: tuple[str, str] = ("info", "text")
) -> None:
    """One rank of a worker node, in its own process: worker_main until the driver stops it (exit 0); a lost
    driver or a failed rendezvous exits 1 without leaving the group (no peer to leave it with)."""
    layout = NodeLayout.of(config.model)
    try:
        worker_main(rank, layout.size, layout.init_method(), config, device_type, None, log)
    except DriverLost:
        os._exit(1)  # ControlChannel logged why
    except Exception as exc:
        logging.getLogger(__name__).error(
            "rank %d on node %d failed: %s", rank, layout.node_rank, str(exc).splitlines()[0]
        )
        os._exit(1)


def run_worker_node(config: EngineConfig) -> int:
    """Run this node's ranks until they end: 0 when the driver stopped them all, else the first failure's code."""
    mc = config.model
    layout = NodeLayout.of(mc)
    from mmserve.models.loader import load_hf_config

    check_tensor_parallel(load_hf_config(mc.model), mc)
    device = resolve_device(mc.device)
    if device.type == "cuda" and torch.cuda.device_count() < layout.per_node:
        raise ValueError(
            f"tensor_parallel_size {layout.size} over nnodes {layout.nnodes} needs {layout.per_node} GPUs "
            f"on each node; {torch.cuda.device_count()} visible"
        )
    ranks = layout.node_ranks
    logger.info(
        "node %d of %d: ranks %d..%d, headless; they wait up to %d s for node 0 at %s",
        layout.node_rank,
        layout.nnodes,
        ranks[0],
        ranks[-1],
        TIMEOUT.total_seconds(),
        layout.init_addr,
    )
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=node_rank_main,
            args=(rank, config, device.type, current_logging()),
            name=f"mmserve-tp{rank}",
        )
        for rank in ranks
    ]
    for proc in procs:
        proc.start()
    stopping = []

    def on_sigterm(signum, frame) -> None:  # stopped from outside: take the ranks along
        stopping.append(signum)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return _wait(procs, ranks, layout, stopping)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _wait(procs: list, ranks: range, layout: NodeLayout, stopping: list) -> int:
    pending = dict(zip(ranks, procs))
    while pending:
        for rank, proc in list(pending.items()):
            proc.join(timeout=0.5)
            if proc.exitcode is None:
                continue
            del pending[rank]
            if stopping:
                continue
            if proc.exitcode != 0:
                logger.error(
                    "node %d: rank %d exited with code %d; stopping the node's other ranks",
                    layout.node_rank,
                    rank,
                    proc.exitcode,
                )
                for other in pending.values():
                    other.terminate()
                return proc.exitcode if proc.exitcode > 0 else 1
    if stopping:
        logger.info("node %d: stopped by signal %d", layout.node_rank, stopping[0])
        return 0
    logger.info("node %d: the driver stopped the group; exiting", layout.node_rank)
    return 0
