"""The outputs room of the engine: a launched step's tokens back into its requests (logprobs, logits,
detokenized text, stop checks) and each request's final output.

It holds the per-request state that only outputs need: the incremental detokenizer, the stop ids, and which
requests read their previous tokens on the host when sampling (the engine then resolves a step before
launching the next).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from mmserve.core.outputs import Logprob, RequestOutput
from mmserve.core.step import RunnerOutput, SchedulerOutput
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.request_output import finish_status, request_output
from mmserve.engine.step_stats import StepStats
from mmserve.worker.launched_step import LaunchedStep
from mmserve.worker.prompt_logprobs import entries as prompt_logprob_entries

logger = logging.getLogger(__name__)


def decodes_per_token(req: Request) -> bool:
    """Streamed requests and those with stop strings need their text as each token arrives; the rest (offline
    batches) decode it once, when they finish."""
    return req.stream or bool(req.params.stop)


def needs_history(req: Request) -> bool:
    """Whether sampling this request's next token reads its previous tokens on the host (penalties; bad words of
    several ids, whose matcher must have taken every output id before the next is sampled; a grammar)."""
    params = req.params
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or (req.bad_words is not None and req.bad_words.longest > 1)
        or req.grammar is not None
    )


@dataclass(slots=True)
class Tracked:
    """A live request's output state: its detokenizer and stop ids, and what its new tokens need."""

    detok: IncrementalDetokenizer
    stop_ids: set[int]
    # grammar, bad words / stop sequences to feed, or text needed per token (decodes_per_token)
    per_token: bool


class OutputProcessor:
    """Applies launched steps to `requests` (the engine's table of live requests, shared) and finishes them."""

    def __init__(
        self,
        tokenizer,
        requests: dict[str, Request],
        finish: Callable[[Request, RequestStatus], None],
        cache_computed_blocks: Callable[[Iterable[Request]], None],
        step_stats: StepStats,
    ) -> None:
        self.tokenizer = tokenizer
        self.requests = requests
        self._finish = finish  # Scheduler.finish: frees the request's blocks
        # KVCacheManager.cache_computed_blocks_of
        self._cache_computed_blocks = cache_computed_blocks
        self.step_stats = step_stats
        self.tracked: dict[str, Tracked] = {}
        self.needs_history: set[str] = set()  # requests whose sampling reads their previous tokens

    def track(self, req: Request) -> None:
        """Start keeping `req`'s output state (it has just been admitted)."""
        rid = req.request_id
        if needs_history(req):
            self.needs_history.add(rid)
        self.tracked[rid] = Tracked(
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params),
            set(req.params.stop_token_ids) | set(req.eos_token_ids),
            req.grammar is not None or decodes_per_token(req),
        )

    def resolve(self, sched: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens back and apply them: detokenize, finish, cache full blocks."""
        result = launched.result()
        self.step_stats.waited(sched.kind, launched.wait_s)
        live, sampled = self._apply(sched, result)
        # blocks whose last ids just arrived can be hashed now; before any request of the step finishes
        self._cache_computed_blocks(live)
        return self._outputs(sampled)

    def _apply(
        self, sched: SchedulerOutput, result: RunnerOutput
    ) -> tuple[list[Request], list[tuple[Request, int, Tracked]]]:
        """Each live request's new token (and context logits) into its state: (the live requests, (request,
        token, its state) of those that sampled)."""
        now = time.time()
        requests, tokens, tracked = self.requests, result.token_ids, self.tracked
        # the per-token extras (prompt logits, logprobs, generation logits) only when some request has them
        context = bool(result.prompt_logprobs or result.context_logits)
        extras = result if result.logprobs or result.generation_logits else None
        live, sampled = [], []
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            if requests.get(rid) is not req:
                continue  # finished or aborted while the step ran; its tokens are dropped
            live.append(req)
            if context:
                self._store_context_logits(req, result)
            if s.samples:
                token, state = tokens[rid], tracked[rid]
                req.fill_pending(token)
                if state.per_token:
                    self._feed(req, token, state.detok)
                if extras is not None:
                    self._append_extras(req, token, extras)
                if req.first_token_time is None:
                    req.first_token_time = now
                sampled.append((req, token, state))
        return live, sampled

    def _outputs(self, sampled: list[tuple[Request, int, Tracked]]) -> list[RequestOutput]:
        """Finish the requests whose new token ends them; the streamed others' outputs."""
        outputs = []
        for req, token, state in sampled:
            status = finish_status(req, token, state.detok, state.stop_ids)
            if status is not None:
                self._finish(req, status)
                outputs.append(self.final_output(req))
            elif req.stream:
                outputs.append(request_output(req, state.detok))
        return outputs

    def final_output(self, req: Request) -> RequestOutput:
        """The final output (held-back text released), then forget the request."""
        detok = self.tracked[req.request_id].detok
        if not detok.finished:
            if not decodes_per_token(req):  # its tokens were not pushed one by one (_feed)
                detok.extend(
                    req.output_token_ids[len(detok.token_ids) : req.num_known_output_tokens]
                )
            detok.flush()
        req.drop_pending()
        out = request_output(req, detok)
        self.tracked.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        self.needs_history.discard(req.request_id)
        return out

    def _store_context_logits(self, req: Request, result: RunnerOutput) -> None:
        """Keep prompt-position logits and prompt logprobs once (a preempted request recomputes positions it
        already has)."""
        chunk = result.prompt_logprobs.get(req.request_id)
        if chunk is not None and 0 <= len(req.prompt_logprobs) - chunk.start < len(chunk.chosen):
            req.prompt_logprobs += prompt_logprob_entries(
                chunk,
                req.prompt_token_ids,
                len(req.prompt_logprobs) - chunk.start,
                self.tokenizer.decode,
            )
        if req.request_id not in result.context_logits:
            return
        start, chunk = result.context_logits[req.request_id]
        skip = req.num_context_logits - start
        if 0 <= skip < len(chunk):
            req.context_logits.append(chunk[skip:])
            req.num_context_logits += len(chunk) - skip

    def _feed(self, req: Request, token: int, detok: IncrementalDetokenizer) -> None:
        """The new token into the request's grammar and, when it decodes per token, its detokenizer."""
        if req.grammar is not None and not req.grammar.accept_token(token):
            logger.warning(
                "%s: token %d is outside its guided-decoding grammar", req.request_id, token
            )
        if decodes_per_token(req):
            detok.push(token)

    def _append_extras(self, req: Request, token: int, result: RunnerOutput) -> None:
        """The new token's log-probs and generation logits from `result`, if the request has them."""
        if req.request_id in result.generation_logits:
            req.generation_logits.append(result.generation_logits[req.request_id])
        if req.params.logprobs is not None and req.request_id in result.logprobs:
            lp = result.logprobs[req.request_id]
            req.cumulative_logprob += lp
            entry = {
                token: Logprob(lp, result.ranks.get(req.request_id), self.tokenizer.decode([token]))
            }
            for rank, (tid, tlp) in enumerate(result.top_logprobs.get(req.request_id, []), start=1):
                if tid != token:
                    entry[tid] = Logprob(tlp, rank, self.tokenizer.decode([tid]))
            req.output_logprobs.append(entry)
