"""AffinityRouter: a Ray Serve request router (`ray.serve.request_router.RequestRouter`) for the engine replicas.

It runs in the process that holds the deployment handle, mmserve's ingress (serving_ray/ingress.py), which passes
each request's routing key (serving_ray/routing_key.py) as the first argument of the call: Ray's own HTTP proxy
hands a replica only the ASGI scope and streams the body afterwards, so a router placed behind it never sees the
body. A key seen before goes to the replica that last served it (an LRU table of `max_keys` keys), unless that
replica is gone or holds `overload_queue_len` requests or more by Ray's queue-length cache; anything else goes to
the least-loaded replica: Ray probes the ranks this router returns and takes the shortest queue among them."""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

MAX_KEYS = 100_000
OVERLOAD_QUEUE_LEN = 32


def key_of(pending_request: PendingRequest | None) -> str | None:
    """The routing key the ingress passed, or None (a call without one, e.g. a broadcast's)."""
    if pending_request is None or not pending_request.args:
        return None
    key = pending_request.args[0]
    return key if isinstance(key, str) and key else None


class AffinityRouter(FIFOMixin, RequestRouter):
    """Same key, same replica (while it is there and not overloaded); else the least loaded. FIFOMixin: Ray's
    routing loop also runs passes with no request in hand and hands their replica to the oldest waiting request;
    without it such a pass fulfils nothing and requests starve under load (Ray's own ConsistentHashRouter notes
    the same). So under concurrency a replica chosen for one key may serve the request queued before it:
    affinity is best-effort, exact for requests that do not queue at the router."""

    def initialize_state(
        self, max_keys: int = MAX_KEYS, overload_queue_len: int = OVERLOAD_QUEUE_LEN
    ) -> None:
        self.max_keys = max_keys
        self.overload_queue_len = overload_queue_len
        self.affinity: OrderedDict[str, ReplicaID] = OrderedDict()

    def preferred(self, key: str | None, candidates: list[RunningReplica]) -> RunningReplica | None:
        """The replica that last served `key`, if it is a candidate and not overloaded."""
        replica_id = self.affinity.get(key) if key is not None else None
        if replica_id is None:
            return None
        for replica in candidates:
            if replica.replica_id == replica_id:
                queue_len = self.replica_queue_len_cache.get(replica_id)
                if queue_len is not None and queue_len >= self.overload_queue_len:
                    return None
                self.affinity.move_to_end(key)
                return replica
        return None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if (
            pending_request is not None
        ):  # one pass over every replica: Ray backs off before the next
            pending_request.routing_context.should_backoff = True
        first = self.preferred(key_of(pending_request), candidate_replicas)
        if (
            first is None
        ):  # Ray takes the shortest queue of a rank, the first on ties: shuffled, ties spread
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        rest = [r for r in candidate_replicas if r.replica_id != first.replica_id]
        return [[first], rest] if rest else [[first]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        key = key_of(pending_request)
        if key is None:
            return
        self.affinity[key] = replica_id
        self.affinity.move_to_end(key)
        while len(self.affinity) > self.max_keys:
            self.affinity.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        for key in [k for k, r in self.affinity.items() if r == replica_id]:
            del self.affinity[key]
