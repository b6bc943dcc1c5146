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
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.stop_ids: dict[str, set[int]] = {}
        self.needs_history: set[str] = set()  # requests whose sampling reads their previous tokens

    def track(self, req: Request) -> None:
        """Start keeping `req`'s output state (it has just been admitted)."""
        rid = req.request_id
        self.stop_ids[rid] = set(req.params.stop_token_ids) | set(req.eos_token_ids)
        if needs_history(req):
            self.needs_history.add(rid)
        self.detokenizers[rid] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, req.params
        )

    def resolve(self, sched: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens back and apply them: detokenize, finish, cache full blocks."""
        result = launched.result()
        self.step_stats.waited(sched.kind, launched.wait_s)
        outputs = []
        now = time.time()
        requests, tokens = self.requests, result.token_ids
        # the per-token extras (prompt logits, logprobs, generation logits) only when some request has them
        context = bool(result.prompt_logprobs or result.context_logits)
        extras = result if result.logprobs or result.generation_logits else None
        live, sampled = [], []
        for s in sched.scheduled:
            req = s.request
            if requests.get(req.request_id) is not req:
                continue  # finished or aborted while the step ran; its tokens are dropped
            live.append(req)
            if context:
                self._store_context_logits(req, result)
            if s.samples:
                token = tokens[req.request_id]
                req.fill_pending(token)
                self._append_token(req, token, extras)
                if req.first_token_time is None:
                    req.first_token_time = now
                sampled.append((req, token))
        # blocks whose last ids just arrived can be hashed now; before any request of the step finishes
        self._cache_computed_blocks(live)
        for req, token in sampled:
            rid = req.request_id
            detok = self.detokenizers[rid]
            status = finish_status(req, token, detok, self.stop_ids[rid])
            if status is not None:
                self._finish(req, status)
                outputs.append(self.final_output(req))
            elif req.stream:
                outputs.append(request_output(req, detok))
        return outputs

    def final_output(self, req: Request) -> RequestOutput:
        """The final output (held-back text released), then forget the request."""
        detok = self.detokenizers[req.request_id]
        if not detok.finished:
            if not decodes_per_token(req):  # its tokens were not pushed one by one (_append_token)
                detok.extend(
                    req.output_token_ids[len(detok.token_ids) : req.num_known_output_tokens]
                )
            detok.flush()
        req.drop_pending()
        out = request_output(req, detok)
        for table in (self.detokenizers, self.stop_ids, self.requests):
            table.pop(req.request_id, None)
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

    def _append_token(self, req: Request, token: int, result: RunnerOutput | None) -> None:
        """The new token into the request's grammar, detokenizer and, from `result` (None: the step has no
        log-probs or generation logits at all), its log-probs and generation logits."""
        if req.grammar is not None and not req.grammar.accept_token(token):
            logger.warning(
                "%s: token %d is outside its guided-decoding grammar", req.request_id, token
            )
        if decodes_per_token(req):
            self.detokenizers[req.request_id].push(token)
        if result is None:
            return
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
