"""What the engine reports for a request: whether a new token finishes it (`finish_status`) and its RequestOutput
(`request_output`), from the request's state and its incremental detokenizer; `ends_with_any` for beam search's
hypotheses."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from mmserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.request import Request, RequestStatus


def finish_status(
    req: Request, token: int, detok: IncrementalDetokenizer, stop_ids: set[int] | frozenset[int]
) -> RequestStatus | None:
    """Whether `token`, just appended, ends the request: a stop id or end id (past min_tokens), a stop string in the
    text (the detokenizer's matcher), a stop token sequence (past min_tokens; the request's matcher took the token in
    Request.fill_pending), or the length limit; records the stop reason. Its cost does not grow with the lists."""
    num_out = req.num_known_output_tokens
    if token in stop_ids and num_out >= req.params.min_tokens:
        req.stop_reason = None if token in req.eos_token_ids else token
        return RequestStatus.FINISHED_STOPPED
    if req.params.stop:
        matched = detok.check_stop()
        if matched is not None:
            req.stop_reason = matched
            return RequestStatus.FINISHED_STOPPED
    if (
        req.stop_sequences is not None
        and req.stop_sequences.ended
        and num_out >= req.params.min_tokens
    ):
        req.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    if num_out >= req.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def ends_with_any(tokens: list[int], sequences: Sequence[list[int]]) -> bool:
    """Whether `tokens` end with one of `sequences` (beam search's stop words and token sequences, per hypothesis)."""
    return any(
        len(seq) <= len(tokens) and tokens[len(tokens) - len(seq) :] == seq for seq in sequences
    )


def request_output(req: Request, detok: IncrementalDetokenizer) -> RequestOutput:
    """The request's output so far (the final one once it finished): text, ids, log-probs, metrics, and the prompt
    log-probs and context / generation logits it asked for."""
    finished, params = req.finished, req.params  # read once: a streamed step makes one per request
    logprobs = params.logprobs is not None
    completion = CompletionOutput(
        index=0,
        text=detok.text,
        token_ids=req.output_token_ids[: req.num_known_output_tokens],
        cumulative_logprob=req.cumulative_logprob if logprobs else None,
        logprobs=list(req.output_logprobs) if logprobs else None,
        finish_reason=req.status.value if finished else None,
        stop_reason=req.stop_reason,
    )
    metrics = RequestMetrics(
        req.arrival_time,
        req.first_scheduled_time,
        req.first_token_time,
        time.time() if finished else None,
        req.num_cached_tokens,
        sum(item.length for item in req.mm_items),
        req.num_images,
        req.num_videos,
        *(req.preprocess_times or (None, None)),
        *(req.encode_times or (None, None)),
    )
    out = RequestOutput(
        req.request_id, req.prompt, req.prompt_token_ids, [completion], finished, metrics
    )
    if (
        params.prompt_logprobs is not None
        and len(req.prompt_logprobs) == len(req.prompt_token_ids) - 1
    ):
        out.prompt_logprobs = [None, *req.prompt_logprobs]
    if finished and params.return_context_logits and req.context_logits:
        out.context_logits = torch.cat(req.context_logits)  # [P, V] fp32
    if finished and params.return_generation_logits and req.generation_logits:
        out.generation_logits = torch.stack(req.generation_logits)  # [G, V] fp32
    return out
