"""The driver's messages to the tensor-parallel ranks on other nodes (multi-node, `distributed/launch.py`).

Workers on the driver's node get ("call" | "forward" | "ping" | "stop", payload) messages by pipe
(`worker/tp_workers.py`); ranks on other nodes get the same messages over torch.distributed: a gloo group of rank 0
and those ranks (on CUDA too: messages are host objects), broadcast from rank 0, with a call's replies gathered
back to it. Gloo sees a peer process exit at once (its sockets close), so a dead node fails the driver's next
message, and a dead driver fails the workers' wait, instead of either waiting on a collective.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mmserve.distributed.launch import NodeLayout

logger = logging.getLogger(__name__)

# a worker waits for the driver's next message as long as the server idles: only a closed socket ends the wait
IDLE_TIMEOUT = timedelta(days=365)


class DriverLost(RuntimeError):
    """A worker on another node lost the driver (rank 0): it exited, or the connection to it broke."""


def join_control_group(layout: NodeLayout) -> dist.ProcessGroup | None:
    """The gloo group of rank 0 and the ranks off node 0 (None on one node). Every rank of the tensor-parallel
    group calls this right after joining it, members or not (torch.distributed's new_group is collective)."""
    if layout.nnodes == 1:
        return None
    return dist.new_group([0, *layout.remote_ranks], timeout=IDLE_TIMEOUT, backend="gloo")


class NodeControl:
    """The driver's side: send a message to every rank off node 0, gather their replies to a call."""

    def __init__(self, group: dist.ProcessGroup, layout: NodeLayout) -> None:
        self.group, self.layout = group, layout
        self.lost: str | None = None  # why the other nodes cannot be reached, once a message failed

    def _died(self, why: str):
        from mmserve.worker.tp_workers import WorkerDied

        ranks = self.layout.remote_ranks
        self.lost = (
            f"tensor-parallel worker on another node (ranks {ranks[0]}..{ranks[-1]} on nodes "
            f"1..{self.layout.nnodes - 1}) is gone ({why.splitlines()[0]}); the engine cannot go on without it"
        )
        return WorkerDied(self.lost)

    def check(self) -> None:
        """WorkerDied when an earlier message found a node gone."""
        if self.lost is not None:
            raise self._died(self.lost)

    def send(self, message: tuple[str, Any]) -> None:
        """Broadcast `message` to the ranks off node 0; WorkerDied when one of them is gone."""
        self.check()
        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except RuntimeError as exc:
            raise self._died(str(exc)) from exc

    def replies(self) -> list[tuple[str, Any]]:
        """Each rank's (status, value) reply to the call just sent, in rank order."""
        self.check()
        gathered: list[Any] = [None] * (len(self.layout.remote_ranks) + 1)
        try:
            dist.gather_object(None, gathered, dst=0, group=self.group)
        except RuntimeError as exc:
            raise self._died(str(exc)) from exc
        return gathered[1:]

    def probe(self) -> None:
        """WorkerDied unless every rank off node 0 can still be sent a message."""
        self.send(("ping", None))


class ControlChannel:
    """A worker's side on another node: recv() and send() as a multiprocessing Connection's (worker_main reads
    either)."""

    def __init__(self, group: dist.ProcessGroup, layout: NodeLayout, rank: int) -> None:
        self.group, self.layout, self.rank = group, layout, rank

    def recv(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as exc:
            logger.error(
                "rank %d on node %d lost the driver (rank 0 on node 0, rendezvous %s): %s",
                self.rank,
                self.layout.node_rank,
                self.layout.init_addr,
                str(exc).splitlines()[0],
            )
            raise DriverLost(str(exc)) from exc
        return box[0]

    def send(self, reply: tuple[str, Any]) -> None:
        dist.gather_object(reply, None, dst=0, group=self.group)
