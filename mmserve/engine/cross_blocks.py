"""Which blocks of the cross-attention pool (worker/cross_kv.py) each running request holds: the scheduler takes
a request's blocks when it admits it and gives them back when it finishes, aborts or is preempted."""

from __future__ import annotations

from mmserve.engine.request import Request


class CrossBlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks held by requests."""
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def fits(self, req: Request) -> bool:
        """Whether req's encoder keys/values fit beside the running requests' (the engine refuses a request
        larger than the whole pool, so the first in line always fits once the others are done)."""
        return req.cross_blocks_needed <= len(self._free) or req.cross_block_ids is not None

    def allocate(self, req: Request) -> None:
        if req.cross_block_ids is not None or not req.cross_blocks_needed:
            return
        n = req.cross_blocks_needed
        if n > len(self._free):
            raise RuntimeError(
                f"{req.request_id}: {n} cross-attention blocks asked, {len(self._free)} free"
            )
        req.cross_block_ids = [self._free.pop() for _ in range(n)]
        req.cross_kv_written = False

    def free(self, req: Request) -> None:
        """Give req's blocks back; a preempted request encodes again when it is admitted again."""
        if req.cross_block_ids is not None:
            self._free.extend(reversed(req.cross_block_ids))
            req.cross_block_ids = None
        req.cross_kv_written = False
