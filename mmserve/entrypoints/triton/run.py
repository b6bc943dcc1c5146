"""Running TritonRequests (protocol.py, tokens.py) on the engine: one request's outputs (beam search, sampled
sequences, plain), a batch answered in one response, and the streaming rules of decoupled models (PROTOCOL §1, §6):
per new text piece or token ids, beams whole, sampled sequences side by side with their sequence_index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

import numpy as np

from mmserve.core.outputs import CompletionOutput, RequestOutput, one_output
from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.streams import merge
from mmserve.entrypoints.triton.models import TRTLLM
from mmserve.entrypoints.triton.outputs import Chunk, full_text, make_outputs
from mmserve.entrypoints.triton.protocol import rename_fields
from mmserve.entrypoints.triton.requests import TritonRequest, with_server_defaults
from mmserve.entrypoints.triton.statistics import Execution
from mmserve.sampling_params import SamplingParams, choice_params


async def generate(state: ServerState, req: TritonRequest) -> AsyncIterator[RequestOutput]:
    """state.generate for one request (beam search's outputs for beam_width > 1: the final one, or with `stream`
    the running beams after each step first; num_return_sequences > 1 without beams: one output of the N sampled
    sequences); closing this generator aborts the request in the engine."""
    try:
        if req.cancel:  # tensorrt_llm `stop`: the requests sent under this id end (their streams send what they have)
            state.cancel(req.client_id)
            yield RequestOutput(
                req.client_id, None, [], [CompletionOutput(0, "", [], finish_reason="abort")], True
            )
            return
        if req.beam_width > 1:
            async with aclosing(
                state.beam_search(
                    req.prompt,
                    req.params,
                    req.beam_width,
                    req.length_penalty,
                    stream=req.stream,
                    client_id=req.client_id,
                )
            ) as steps:
                async for out in steps:
                    del out.outputs[req.num_return :]
                    yield out
            return
        if (
            req.num_return > 1
        ):  # sampled sequences: one engine request each (seed + i), answered together
            yield await _sampled_sequences(state, req)
            return
        async with aclosing(
            state.generate(req.prompt, req.params, client_id=req.client_id)
        ) as outputs:
            async for out in outputs:
                yield out
    except ValueError as exc:
        raise ValueError(rename_fields(str(exc), req)) from exc


async def _sampled_sequences(state: ServerState, req: TritonRequest) -> RequestOutput:
    """num_return_sequences N without beams: N requests of the prompt (its KV cache computed once and shared), their
    final outputs as one output of N completions."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(state.generate_final(req.prompt, p, req.client_id))
                for p in choice_params(req.params, req.num_return)
            ]
    except BaseExceptionGroup as group_error:
        raise group_error.exceptions[0] from None
    return one_output([t.result() for t in tasks])


async def infer(state: ServerState, reqs: list[TritonRequest]) -> dict[str, np.ndarray]:
    """Run every batch item to completion (concurrently) and build the single response's tensors."""
    reqs = [with_server_defaults(r, state.config) for r in reqs]
    with state.statistics.execution(reqs[0].model, len(reqs)) as execution:
        return await _infer(state, reqs, execution)


async def _infer(
    state: ServerState, reqs: list[TritonRequest], execution: Execution
) -> dict[str, np.ndarray]:
    async def one(req: TritonRequest) -> Chunk:
        last = None
        async with aclosing(generate(state, req)) as outputs:
            async for out in outputs:
                last = out
        execution.finished(last)
        several = len(last.outputs) > 1  # beams, or sampled sequences
        if req.model == TRTLLM:  # token ids only: nothing to decode
            beams = [""] * len(last.outputs) if several else None
            return Chunk(
                "",
                last,
                0,
                req.return_log_probs,
                beams,
                with_prompt=not req.exclude_input,
                pad_id=req.pad_id,
            )
        texts = [
            full_text(state.engine.tokenizer, last, req.exclude_input, k)
            for k in range(len(last.outputs))
        ]
        return Chunk(texts[0], last, 0, req.return_log_probs, texts if several else None)

    if len(reqs) == 1:
        chunks = [await one(reqs[0])]
    else:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(r)) for r in reqs]
        except BaseExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        chunks = [t.result() for t in tasks]
    return make_outputs(chunks, reqs[0].model, state.engine.model_info.block_size)


async def stream(
    state: ServerState, req: TritonRequest, accumulate: bool = False
) -> AsyncIterator[tuple[dict[str, np.ndarray], bool]]:
    """Responses of a decoupled model: (tensors, is_last). With `stream` true, one per new text piece
    (only the new text, or all text so far when `accumulate`; the tensorrt_llm model: per new tokens, their
    ids), the last one at finish; otherwise one response with the full text."""
    req = with_server_defaults(req, state.config)
    if not req.stream:
        yield await infer(state, [req]), True
        return
    block_size = state.engine.model_info.block_size
    with state.statistics.execution(
        req.model, 1
    ) as execution:  # a stream closed early counts as a fail
        if req.num_return > 1 and req.beam_width == 1 and not req.cancel:
            sent = [(0, 0)] * req.num_return
            running = req.num_return
            async with aclosing(_sampled_streams(state, req)) as outputs:
                async for index, out in outputs:
                    chunk = _stream_chunk(req, out, *sent[index], accumulate)
                    running -= out.finished
                    if chunk is not None:
                        sent[index] = len(out.outputs[0].text), len(out.outputs[0].token_ids)
                        chunk.sequence_index = index
                        yield make_outputs([chunk], req.model, block_size), running == 0
            return
        sent_chars = sent_tokens = 0
        async with aclosing(generate(state, req)) as outputs:
            async for out in outputs:
                if out.finished:
                    execution.finished(out)
                chunk = _stream_chunk(req, out, sent_chars, sent_tokens, accumulate)
                if chunk is None:
                    continue
                sent_chars, sent_tokens = len(out.outputs[0].text), len(out.outputs[0].token_ids)
                yield make_outputs([chunk], req.model, block_size), out.finished


def _stream_chunk(
    req: TritonRequest, out: RequestOutput, sent_chars: int, sent_tokens: int, accumulate: bool
) -> Chunk | None:
    """What a streamed response carries for `out`, given how much of its first completion was sent already; None
    when there is nothing new and it has not finished."""
    completion = out.outputs[0]
    if req.beam_width > 1:  # beams change from step to step: each response carries them whole
        beams = [c.text for c in out.outputs]
        return Chunk(beams[0], out, 0, req.return_log_probs, beams, pad_id=req.pad_id)
    if req.model == TRTLLM:
        if len(completion.token_ids) == sent_tokens and not out.finished:
            return None
        return Chunk("", out, sent_tokens, req.return_log_probs, pad_id=req.pad_id)
    if len(completion.text) == sent_chars and not out.finished:
        return None
    piece = completion.text if accumulate else completion.text[sent_chars:]
    return Chunk(piece, out, sent_tokens, req.return_log_probs)


async def _sampled_streams(
    state: ServerState, req: TritonRequest
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """num_return_sequences N without beams, streamed: the N sampled sequences' outputs as they come, each with
    its sequence's index (TensorRT-LLM's `sequence_index`). Closing this generator aborts all N."""

    async def tagged(
        index: int, params: SamplingParams
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        async with aclosing(state.generate(req.prompt, params, client_id=req.client_id)) as outputs:
            async for out in outputs:
                yield index, out

    try:
        async with aclosing(
            merge([tagged(i, p) for i, p in enumerate(choice_params(req.params, req.num_return))])
        ) as outputs:
            async for item in outputs:
                yield item
    except ValueError as exc:
        raise ValueError(rename_fields(str(exc), req)) from exc
