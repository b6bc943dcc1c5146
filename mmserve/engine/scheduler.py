"""Continuous-batching scheduler.

The one rule: there is no prefill or decode phase. Each step, every request's computed tokens
catch up with its total tokens (prompt + generated) as far as the step's token budget allows.
Running requests go first (FCFS), then waiting ones; a prompt may be cut anywhere (chunked
prefill). When KV blocks run out, the latest-arrived running request is preempted: its blocks are
freed and it is recomputed later (cached prefix blocks make that cheap). A new request whose whole prompt was
computed before (every prompt block cached, and its final hidden state kept: PromptEndCache) is scheduled
with zero tokens to compute: its first token is sampled from the kept state, and its next step computes the
prompt's uncached tail with that token. Waiting copies of a prompt that a running request is computing let
others pass and wait for it, so a burst of one prompt computes it once.
"""

from __future__ import annotations

import time
from collections import deque

from mmserve.config import SchedulerConfig
from mmserve.core.step import ScheduledRequest, SchedulerOutput
from mmserve.engine.cross_blocks import CrossBlockAllocator
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.prompt_end_cache import PromptEndCache
from mmserve.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, prompt_ends: PromptEndCache | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.prompt_ends = prompt_ends  # the engine makes one only with prefix caching on
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # cross-attention families: the pool blocks of the running requests' encoder keys/values
        self.cross_blocks: CrossBlockAllocator | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV slots.

        Returns:
            SchedulerOutput with each request's [start, end) chunk and its block table; one-token chunks
            come first.
        """
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        # one-token chunks (decodes) first, in order: attention backends split a mixed batch there; prompt-end
        # loads (nothing to compute) last
        scheduled = out.scheduled
        ones = [s for s in scheduled if s.num_tokens == 1]
        if len(ones) != len(scheduled):
            ones += [s for s in scheduled if s.num_tokens > 1]
            ones += [s for s in scheduled if s.num_tokens == 0]
            out.scheduled = ones
        out.block_table = self.kv.rows.array
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first, in order, each as far as the budget goes (preempting the latest-arrived
        while blocks run out); returns the budget left."""
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_out = len(req.output_token_ids)
            if num_out >= req.max_output_tokens:
                i += 1  # its last token is still in flight; it finishes when that arrives
                continue
            num_tokens = len(req.prompt_token_ids) + num_out
            n = min(num_tokens - req.num_computed_tokens, budget)
            if self._make_room(req, n, num_out > 0, out):
                out.scheduled.append(self._scheduled(req, n, num_tokens))
                budget -= n
                i += 1
        return budget

    def _make_room(self, req: Request, n: int, decoding: bool, out: SchedulerOutput) -> bool:
        """Blocks for req's next n tokens, preempting the latest-arrived running requests while they run out;
        False when req itself had to go. A request past its prompt whose blocks have room (most decodes) needs no
        allocation."""
        if decoding and self.kv.has_room(req, n):
            return True
        while not self.kv.allocate_slots(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while budget and sequence slots last. A new request whose prompt a
        running request is computing (same digest) lets the others pass and waits: once that twin's last prompt
        chunk is launched its blocks and prompt end are there, and the request computes nothing for its prompt
        (a burst of one prompt costs one prefill)."""
        computing: set[bytes] | None = (
            None  # digests of prompts being computed (built on first need)
        )
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            fresh = req.num_computed_tokens == 0 and not req.params.needs_prompt_logits
            if fresh and self.prompt_ends is not None and not req.num_output_tokens:
                if computing is None:
                    computing = {
                        self.kv.prompt_digest(r)
                        for r in self.running
                        if not r.num_output_tokens and r.num_computed_tokens < r.num_prompt_tokens
                    }
                if self.kv.prompt_digest(req) in computing:
                    i += 1
                    continue
            hits, num_hit_tokens = [], 0
            if fresh:
                hits, num_hit_tokens = self.kv.get_computed_blocks(
                    req
                )  # cached positions yield no logits
            remaining = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            load = self._prompt_end_hit(req, num_hit_tokens)
            n = 0 if load is not None else min(remaining, budget)
            if n < remaining and not self.config.enable_chunked_prefill:
                break
            if self.cross_blocks is not None and not self.cross_blocks.fits(req):
                break
            if not self.kv.allocate_slots(req, n, hits):
                break
            if self.cross_blocks is not None:
                self.cross_blocks.allocate(req)
            del self.waiting[i]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens += num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if load is not None:
                self.prompt_ends.hits += 1
                out.scheduled.append(
                    ScheduledRequest(
                        req,
                        req.num_computed_tokens,
                        0,
                        self.kv.block_ids(req.request_id),
                        True,
                        load_prompt_end=load,
                    )
                )
            else:
                out.scheduled.append(self._scheduled(req, n))
                if computing is not None and not req.num_output_tokens:
                    computing.add(self.kv.prompt_digest(req))
            budget -= n

    def _release_cross_blocks(self, req: Request) -> None:
        if self.cross_blocks is not None:
            self.cross_blocks.free(req)

    def _prompt_end_hit(self, req: Request, num_hit_tokens: int) -> int | None:
        """The prompt-end slot of a new request whose prompt blocks are all cached and whose prompt's final
        hidden state is kept, else None."""
        if (
            self.prompt_ends is None
            or req.num_output_tokens
            or num_hit_tokens == 0
            or num_hit_tokens != self.kv.max_hit_blocks(req) * self.kv.block_size
        ):
            return None
        return self.prompt_ends.lookup(self.kv.prompt_digest(req))

    def _scheduled(self, req: Request, n: int, num_tokens: int | None = None) -> ScheduledRequest:
        """req's chunk of n tokens from its computed ones (num_tokens: req.num_tokens, when the caller has it)."""
        start = req.num_computed_tokens
        end = start + n
        if num_tokens is None:
            num_tokens = req.num_tokens
        store = None
        if end == num_tokens == len(req.prompt_token_ids) and self.prompt_ends is not None:
            store = self.prompt_ends.claim(self.kv.prompt_digest(req))
        rid = req.request_id
        return ScheduledRequest(
            req,
            start,
            n,
            self.kv.block_ids(rid),
            end == num_tokens,
            None,
            store,
            self.kv.rows.row(rid),
        )

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self._release_cross_blocks(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End req (stop, length or abort) wherever it is, and free its blocks."""
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self._release_cross_blocks(req)
