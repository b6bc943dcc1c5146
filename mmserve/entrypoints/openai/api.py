"""OpenAI-compatible routes: /v1/models, /v1/chat/completions (text + images), /v1/completions.

Every request goes through ServerState.generate, once per choice (`n`, see fanout.py). Errors use
OpenAI's JSON shape {"error": {"message", "type", "param", "code"}}; streams are SSE `data: {chunk}` events
ending in `data: [DONE]`. A client that disconnects aborts every choice's engine request.
Request parsing lives in requests.py, the building of answers in responses.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from mmserve.core.outputs import RequestOutput
from mmserve.entrypoints.json_wire import WireJSONResponse
from mmserve.entrypoints.openai.fanout import (
    ChoiceRun,
    close_choices,
    engine_error,
    finish_choices,
    start_beam_choices,
    start_choices,
)
from mmserve.entrypoints.openai.openapi import openai_route
from mmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    Usage,
    new_id,
    now,
)
from mmserve.entrypoints.openai.requests import (
    beam_width_of,
    chat_params,
    chat_prompt,
    check_model,
    completion_params,
    completion_prompt,
    num_choices,
    parse_body,
    with_lora,
)
from mmserve.entrypoints.openai.responses import (
    OpenAIError,
    ResponseContext,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    echo_logprobs,
    sse,
    usage_of,
)
from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.streams import merge
from mmserve.sampling_params import choice_params

logger = logging.getLogger(__name__)
router = APIRouter()


# ---- routes --------------------------------------------------------------------------------


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    cards = ModelList(data=[_card(state, name) for name in state.model_names])
    return WireJSONResponse(cards.model_dump(exclude_none=True))


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    try:
        check_model(_state(request), model)
    except OpenAIError as e:
        return e.response()
    return WireJSONResponse(_card(_state(request), model).model_dump(exclude_none=True))


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, parent=state.model_name if name in state.lora_names else None)


@router.post(
    "/v1/chat/completions",
    **openai_route(ChatCompletionRequest, ChatCompletionResponse, streams=True),
)
async def chat_completions(request: Request) -> Response:
    try:
        state = _state(request)
        req = await parse_body(request, ChatCompletionRequest)
        check_model(state, req.model)
        n = num_choices(req)
        params = await chat_params(req, state)
        prompt = with_lora(chat_prompt(req.messages, state), req.model, state)
        ctx = ResponseContext(new_id("chatcmpl"), now(), req.model, req.logprobs)
        if width := beam_width_of(req, params, n):
            runs = start_beam_choices(state, prompt, params, width, req.length_penalty, ctx.id)
        else:
            runs = await start_choices(
                state, prompt, choice_params(params, n), ctx.id, media_param="messages"
            )
    except OpenAIError as e:
        return e.response()
    return await _reply(request, req, runs, ctx, _CHAT)


@router.post("/v1/completions", **openai_route(CompletionRequest, CompletionResponse, streams=True))
async def completions(request: Request) -> Response:
    try:
        state = _state(request)
        req = await parse_body(request, CompletionRequest)
        check_model(state, req.model)
        n = num_choices(req)
        params = await completion_params(req, state)
        prompt = with_lora(completion_prompt(req), req.model, state)
        echo = ""
        if req.echo:
            echo = (
                prompt["prompt"]
                if "prompt" in prompt
                else state.engine.tokenizer.decode(prompt["prompt_token_ids"])
            )
        ctx = ResponseContext(new_id("cmpl"), now(), req.model, req.logprobs is not None, echo)
        if width := beam_width_of(req, params, n):
            runs = start_beam_choices(state, prompt, params, width, req.length_penalty, ctx.id)
        else:
            runs = await start_choices(
                state, prompt, choice_params(params, n), ctx.id, media_param="prompt"
            )
        if (
            req.echo and req.logprobs is not None
        ):  # the first output comes once the prompt is computed
            ctx = dataclasses.replace(
                ctx, echo_logprobs=echo_logprobs(runs[0].last, state.engine.tokenizer.decode)
            )
    except OpenAIError as e:
        return e.response()
    return await _reply(request, req, runs, ctx, _COMPLETION)


def _state(request: Request) -> ServerState:
    return request.app.state.mm


# ---- answering a started request -----------------------------------------------------------


@dataclass(frozen=True)
class _Answer:
    """How one endpoint answers: a choice's stream chunks, the usage chunk, the whole response."""

    choice_events: Callable[[ChoiceRun, ResponseContext], AsyncIterator[str]]
    usage_chunk: Callable[[ResponseContext, Usage], str]
    body: Callable[[ResponseContext, list[RequestOutput]], BaseModel]


async def _reply(
    request: Request,
    req: ChatCompletionRequest | CompletionRequest,
    runs: list[ChoiceRun],
    ctx: ResponseContext,
    answer: _Answer,
) -> Response:
    """The SSE stream of a started request, or (not streaming) its whole response once every choice has finished."""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSEResponse(
            _events(runs, ctx, answer, include_usage), cleanup=lambda: close_choices(runs)
        )
    try:
        await _collect(request, runs)
    except OpenAIError as e:
        return e.response()
    return WireJSONResponse(answer.body(ctx, [run.last for run in runs]).model_dump(mode="json"))


async def _collect(request: Request, runs: list[ChoiceRun]) -> None:
    """Run a non-streaming request's choices to their final outputs; abort them all if the client disconnects
    meanwhile."""
    task = asyncio.ensure_future(finish_choices(runs))
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # the client is gone (or we were cancelled): closing the streams aborts the requests
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise OpenAIError(499, "the client closed the connection", "client_closed_request")
    task.result()  # raises a choice's failure as an OpenAIError


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """text/event-stream whose generator is always closed and `cleanup` always awaited, also when the client
    went away mid-stream or before the stream began (Starlette cancels the send loop on disconnect, which would
    otherwise leave the requests running until the garbage collector finalised their generators)."""

    def __init__(self, events: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._cleanup()


# ---- streaming ---------------------------------------------------------------------------


async def _events(
    runs: list[ChoiceRun], ctx: ResponseContext, answer: _Answer, include_usage: bool
) -> AsyncIterator[str]:
    """Every choice's chunks, interleaved as they come; then the usage chunk (include_usage) and [DONE].
    A failing choice aborts the others and ends the stream with its error event."""
    try:
        async with contextlib.aclosing(
            merge([answer.choice_events(run, ctx) for run in runs])
        ) as chunks:
            async for chunk in chunks:
                yield chunk
    except OpenAIError as e:
        yield sse(e.body())
    except Exception as e:  # a fault of ours: the stream still ends the way clients expect
        logger.error("stream %s failed", ctx.id, exc_info=e)
        yield sse(
            OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "server_error").body()
        )
    else:
        if include_usage:
            yield answer.usage_chunk(ctx, usage_of([run.last for run in runs]))
    yield "data: [DONE]\n\n"


async def _deltas(run: ChoiceRun) -> AsyncIterator[tuple[str, list]]:
    """(new text, new logprob entries) for each output of one choice, its first included; keeps run.last.
    An engine failure is raised as an OpenAIError; closing this closes the choice's stream (aborting it)."""
    sent_text = sent_lp = 0
    async with contextlib.aclosing(run.stream):
        while True:
            comp = run.last.outputs[0]
            lps = comp.logprobs or []
            yield comp.text[sent_text:], lps[sent_lp:]
            sent_text, sent_lp = len(comp.text), len(lps)
            if run.last.finished:
                return
            try:
                run.last = await anext(run.stream)
            except StopAsyncIteration:
                return
            except Exception as e:
                raise engine_error(e, "messages") from None


async def _chat_choice_events(run: ChoiceRun, ctx: ResponseContext) -> AsyncIterator[str]:
    """One choice's chat chunks: the role first, then the content deltas, then its finish_reason."""
    yield chat_chunk(ctx, Delta(role="assistant", content=""), index=run.index)
    async with contextlib.aclosing(_deltas(run)) as deltas:
        async for text, lps in deltas:
            if text or lps:
                yield chat_chunk(ctx, Delta(content=text), lps, index=run.index)
    yield chat_chunk(ctx, Delta(), finish=run.last.outputs[0].finish_reason, index=run.index)


async def _completion_choice_events(run: ChoiceRun, ctx: ResponseContext) -> AsyncIterator[str]:
    """One choice's completion chunks: the echo (if asked), then the text deltas, then its finish_reason."""
    offset = len(ctx.echo)
    if ctx.echo:
        yield completion_chunk(ctx, ctx.echo, ctx.echo_logprobs, index=run.index)
    async with contextlib.aclosing(_deltas(run)) as deltas:
        async for text, lps in deltas:
            if text or lps:
                logprobs = completion_logprobs(lps, offset) if ctx.logprobs else None
                offset += sum(len(t) for t in logprobs.tokens) if logprobs else 0
                yield completion_chunk(ctx, text, logprobs, index=run.index)
    yield completion_chunk(ctx, "", finish=run.last.outputs[0].finish_reason, index=run.index)


_CHAT = _Answer(
    _chat_choice_events, lambda ctx, usage: chat_chunk(ctx, Delta(), usage=usage), chat_response
)
_COMPLETION = _Answer(
    _completion_choice_events,
    lambda ctx, usage: completion_chunk(ctx, "", usage=usage),
    completion_response,
)
