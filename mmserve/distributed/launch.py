"""Where the ranks of a multi-node tensor-parallel group live: `--nnodes N --node-rank R --dist-init-addr HOST:PORT`,
or, where those are not given, the variables torchrun or a Kubernetes LeaderWorkerSet set.

Each node runs k = tensor_parallel_size / nnodes ranks, one per GPU (cuda:LOCAL_RANK): node r holds the global
ranks r*k .. r*k+k-1. Node 0's first rank is the driver (the server); the other nodes run headless
(`worker/node_workers.py`). Every rank meets at node 0's TCPStore (torch.distributed's `tcp://` rendezvous), which
the driver hosts, or which torchrun's agent hosts when MASTER_ADDR:MASTER_PORT is its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from mmserve.config import parse_host_port

DEFAULT_PORT = 29500  # torch.distributed's usual MASTER_PORT: LeaderWorkerSet gives an address only


@dataclass(frozen=True)
class NodeLayout:
    """The tensor-parallel group's ranks over its nodes, and where they meet."""

    size: int  # tensor_parallel_size: ranks in all
    nnodes: int = 1
    node_rank: int = 0
    init_addr: str | None = None  # HOST:PORT of the rendezvous; None: one node, a loopback port

    @classmethod
    def of(cls, mc) -> NodeLayout:
        """The layout a ModelConfig asks for (its nnodes / node_rank None: one node, node 0)."""
        return cls(mc.tensor_parallel_size, mc.nnodes or 1, mc.node_rank or 0, mc.dist_init_addr)

    @property
    def per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks that run on this node."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    @property
    def remote_ranks(self) -> list[int]:
        """The ranks off node 0: the driver reaches them through torch.distributed, not a pipe."""
        return list(range(self.per_node, self.size))

    def local_rank(self, rank: int) -> int:
        return rank % self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def init_method(self) -> str | None:
        """tcp://HOST:PORT of the rendezvous (None on one node: the driver picks a loopback port)."""
        if self.init_addr is None:
            return None
        host, port = parse_host_port(self.init_addr)
        return f"tcp://{host}:{port}"


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def launcher_values(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    """nnodes, node_rank and dist_init_addr that torchrun (WORLD_SIZE, GROUP_RANK / NODE_RANK / RANK, MASTER_ADDR,
    MASTER_PORT) or a LeaderWorkerSet (LWS_GROUP_SIZE, LWS_WORKER_INDEX, LWS_LEADER_ADDRESS) set: field ->
    (value, the variable). torchrun must start one process per node (--nproc-per-node 1): mmserve starts a node's
    ranks itself."""
    found: dict[str, tuple[object, str]] = {}
    if "WORLD_SIZE" in environ:
        if environ.get("LOCAL_WORLD_SIZE", "1") != "1" or environ.get("LOCAL_RANK", "0") != "0":
            raise ValueError(
                f"LOCAL_WORLD_SIZE {environ.get('LOCAL_WORLD_SIZE')}: start one mmserve per node "
                "(torchrun --nproc-per-node 1); it starts tensor_parallel_size / nnodes ranks itself"
            )
        found["nnodes"] = (_int(environ, "WORLD_SIZE"), "WORLD_SIZE")
        rank_var = next(
            v for v in ("GROUP_RANK", "NODE_RANK", "RANK", "WORLD_SIZE") if v in environ
        )
        if rank_var != "WORLD_SIZE":
            found["node_rank"] = (_int(environ, rank_var), rank_var)
        if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
            addr = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
            found["dist_init_addr"] = (addr, "MASTER_ADDR:MASTER_PORT")
    elif "LWS_GROUP_SIZE" in environ:
        found["nnodes"] = (_int(environ, "LWS_GROUP_SIZE"), "LWS_GROUP_SIZE")
        if "LWS_WORKER_INDEX" in environ:
            found["node_rank"] = (_int(environ, "LWS_WORKER_INDEX"), "LWS_WORKER_INDEX")
        if "LWS_LEADER_ADDRESS" in environ:
            port = environ.get("MASTER_PORT", str(DEFAULT_PORT))
            found["dist_init_addr"] = (
                f"{environ['LWS_LEADER_ADDRESS']}:{port}",
                "LWS_LEADER_ADDRESS",
            )
    return found


def apply_launcher_env(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill `serve`'s nnodes / node_rank / dist_init_addr that no flag, MMSERVE_ variable or --config set from
    torchrun's or LeaderWorkerSet's variables (recorded in args.sources, so errors name the variable)."""
    for name, (value, var) in launcher_values(environ).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
            getattr(args, "sources", {})[name] = var
