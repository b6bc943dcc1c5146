"""OpenAI-compatible routes: /v1/models, /v1/chat/completions (text + images), /v1/completions.

Every request goes through ServerState.generate. Errors use OpenAI's JSON shape
{"error": {"message", "type", "param", "code"}}; streams are SSE `data: {chunk}` events ending in
`data: [DONE]`. A client that disconnects mid-stream closes the generator, which aborts the request.
Request parsing lives in openai_requests.py, the building of answers in openai_responses.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from mmserve.engine.engine import EngineOverloaded
from mmserve.entrypoints.openai_protocol import (
    ChatCompletionRequest, CompletionRequest, Delta, ModelCard, ModelList, new_id, now)
from mmserve.entrypoints.openai_requests import (
    chat_params, chat_prompt, check_model, completion_params, completion_prompt, parse_body)
from mmserve.entrypoints.openai_responses import (
    OpenAIError, ResponseContext, chat_chunk, chat_response, completion_chunk, completion_logprobs,
    completion_response, sse, usage_of)
from mmserve.entrypoints.state import ServerBusy, ServerState
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
router = APIRouter()


# ---- routes --------------------------------------------------------------------------------

@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    return JSONResponse(ModelList(data=[ModelCard(id=name) for name in state.model_names]).model_dump())


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    try:
        check_model(_state(request), model)
    except OpenAIError as e:
        return e.response()
    return JSONResponse(ModelCard(id=model).model_dump())


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    try:
        state = _state(request)
        req = await parse_body(request, ChatCompletionRequest)
        check_model(state, req.model)
        params = chat_params(req, state)
        prompt = chat_prompt(req, state)
        gen, first = await _start(state, prompt, params, media_param="messages")
    except OpenAIError as e:
        return e.response()
    ctx = ResponseContext(new_id("chatcmpl"), now(), req.model, req.logprobs)
    return await _reply(request, req, gen, first, ctx, _chat_events, chat_response)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    try:
        state = _state(request)
        req = await parse_body(request, CompletionRequest)
        check_model(state, req.model)
        params = completion_params(req, state)
        prompt = completion_prompt(req)
        gen, first = await _start(state, prompt, params, media_param="prompt")
    except OpenAIError as e:
        return e.response()
    echo = ""
    if req.echo:
        echo = prompt["prompt"] if "prompt" in prompt else state.engine.tokenizer.decode(prompt["prompt_token_ids"])
    ctx = ResponseContext(new_id("cmpl"), now(), req.model, req.logprobs is not None, echo)
    return await _reply(request, req, gen, first, ctx, _completion_events, completion_response)


def _state(request: Request) -> ServerState:
    return request.app.state.mm


# ---- running a request ---------------------------------------------------------------------

async def _reply(request: Request, req: ChatCompletionRequest | CompletionRequest,
                 gen: AsyncIterator[RequestOutput], first: RequestOutput, ctx: ResponseContext,
                 events: Callable[[AsyncIterator[RequestOutput], RequestOutput, ResponseContext, bool],
                                  AsyncIterator[str]],
                 body: Callable[[ResponseContext, RequestOutput], BaseModel]) -> Response:
    """The SSE stream of a started request, or (not streaming) its whole response once it has finished."""
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSEResponse(events(gen, first, ctx, include_usage))
    try:
        out = await _collect(request, gen, first)
    except OpenAIError as e:
        return e.response()
    return JSONResponse(body(ctx, out).model_dump(mode="json"))


async def _start(state: ServerState, prompt: dict[str, Any], params: SamplingParams,
                 media_param: str) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
    """Queue the request and wait for its first output, so input errors still get their own status code."""
    if state.engine.dead_error is not None:
        raise OpenAIError(503, f"the engine has stopped: {state.engine.dead_error}", "server_error")
    gen = state.generate(prompt, params)
    try:
        first = await anext(gen)
    except BaseException as e:
        await gen.aclose()
        if isinstance(e, Exception):
            raise _engine_error(e, media_param) from None
        raise
    return gen, first


def _engine_error(e: Exception, media_param: str) -> OpenAIError:
    if isinstance(e, (ServerBusy, EngineOverloaded)):
        return OpenAIError(503, f"the server is overloaded: {e}", "server_error", code="server_overloaded")
    if isinstance(e, (ValueError, TypeError)):
        # prompt / media problems; the message names the field (e.g. "images[0]: ...")
        return OpenAIError(400, str(e), param=media_param)
    logger.error("request failed: %s: %s", type(e).__name__, e)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def _collect(request: Request, gen: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    """Run a non-streaming request to its final output; abort it if the client disconnects meanwhile."""
    async def run() -> RequestOutput:
        last = first
        async with contextlib.aclosing(gen):
            async for out in gen:
                last = out
        return last

    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()   # the client is gone (or we were cancelled): closing gen aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise OpenAIError(499, "the client closed the connection", "client_closed_request")
    try:
        return task.result()
    except Exception as e:
        raise _engine_error(e, "messages") from None


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _SSEResponse(StreamingResponse):
    """text/event-stream whose generator is always closed, also when the client went away mid-stream
    (Starlette cancels the send loop on disconnect, which would otherwise leave the generator suspended
    and the request running until the garbage collector finalised it)."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


# ---- streaming ---------------------------------------------------------------------------

async def _deltas(gen: AsyncIterator[RequestOutput], first: RequestOutput,
                  on_error: Callable[[OpenAIError], None]) -> AsyncIterator[tuple[RequestOutput, str, list]]:
    """(output, new text, new logprob entries) for each output of the stream, first included."""
    sent_text = sent_lp = 0
    out: RequestOutput | None = first
    while out is not None:
        comp = out.outputs[0]
        lps = comp.logprobs or []
        yield out, comp.text[sent_text:], lps[sent_lp:]
        sent_text, sent_lp = len(comp.text), len(lps)
        if out.finished:
            return
        try:
            out = await anext(gen)
        except StopAsyncIteration:
            return
        except Exception as e:
            on_error(_engine_error(e, "messages"))
            return


async def _chat_events(gen: AsyncIterator[RequestOutput], first: RequestOutput, ctx: ResponseContext,
                       include_usage: bool) -> AsyncIterator[str]:
    errors: list[OpenAIError] = []
    async with contextlib.aclosing(gen):
        yield chat_chunk(ctx, Delta(role="assistant", content=""))
        last = first
        async for out, text, lps in _deltas(gen, first, errors.append):
            last = out
            if text or lps:
                yield chat_chunk(ctx, Delta(content=text), lps)
        if errors:
            yield sse(errors[0].body())
        else:
            yield chat_chunk(ctx, Delta(), finish=last.outputs[0].finish_reason)
            if include_usage:
                yield chat_chunk(ctx, Delta(), usage=usage_of(last))
    yield "data: [DONE]\n\n"


async def _completion_events(gen: AsyncIterator[RequestOutput], first: RequestOutput, ctx: ResponseContext,
                             include_usage: bool) -> AsyncIterator[str]:
    errors: list[OpenAIError] = []
    async with contextlib.aclosing(gen):
        offset = len(ctx.echo)
        if ctx.echo:
            yield completion_chunk(ctx, ctx.echo)
        last = first
        async for out, text, lps in _deltas(gen, first, errors.append):
            last = out
            if text or lps:
                logprobs = completion_logprobs(lps, offset) if ctx.logprobs else None
                offset += sum(len(t) for t in logprobs.tokens) if logprobs else 0
                yield completion_chunk(ctx, text, logprobs)
        if errors:
            yield sse(errors[0].body())
        else:
            yield completion_chunk(ctx, "", finish=last.outputs[0].finish_reason)
            if include_usage:
                yield completion_chunk(ctx, "", usage=usage_of(last))
    yield "data: [DONE]\n\n"
