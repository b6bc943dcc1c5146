"""OpenAI-compatible routes: /v1/models, /v1/chat/completions (text + images), /v1/completions.

Every request goes through ServerState.generate. Errors use OpenAI's JSON shape
{"error": {"message", "type", "param", "code"}}; streams are SSE `data: {chunk}` events ending in
`data: [DONE]`. A client that disconnects mid-stream closes the generator, which aborts the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from mmserve.engine.engine import EngineOverloaded
from mmserve.entrypoints.openai_protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, Delta, ErrorInfo, ErrorResponse, ModelCard, ModelList, PromptTokensDetails,
    TokenLogprob, TopLogprob, Usage, new_id, now)
from mmserve.entrypoints.state import ServerBusy, ServerState
from mmserve.outputs import Logprob, RequestOutput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
router = APIRouter()

_RETRY_AFTER_S = "1"


class OpenAIError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        headers = {"Retry-After": _RETRY_AFTER_S} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# ---- routes --------------------------------------------------------------------------------

@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = _state(request)
    return JSONResponse(ModelList(data=[ModelCard(id=name) for name in state.model_names]).model_dump())


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    try:
        _check_model(_state(request), model)
    except OpenAIError as e:
        return e.response()
    return JSONResponse(ModelCard(id=model).model_dump())


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    try:
        state = _state(request)
        req = await _parse(request, ChatCompletionRequest)
        _check_model(state, req.model)
        params = _chat_params(req, state)
        prompt = _chat_prompt(req, state)
        gen, first = await _start(state, prompt, params, media_param="messages")
    except OpenAIError as e:
        return e.response()
    ctx = _Context(new_id("chatcmpl"), now(), req.model, req.logprobs)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSEResponse(_chat_events(gen, first, ctx, include_usage))
    try:
        out = await _collect(request, gen, first)
    except OpenAIError as e:
        return e.response()
    comp = out.outputs[0]
    choice = ChatChoice(message=AssistantMessage(content=comp.text), finish_reason=comp.finish_reason,
                        logprobs=ChatLogprobs(content=_chat_logprobs(comp.logprobs)) if req.logprobs else None)
    body = ChatCompletionResponse(id=ctx.id, created=ctx.created, model=req.model, choices=[choice],
                                  usage=_usage(out))
    return JSONResponse(body.model_dump(mode="json"))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    try:
        state = _state(request)
        req = await _parse(request, CompletionRequest)
        _check_model(state, req.model)
        params = _completion_params(req, state)
        prompt = _completion_prompt(req)
        gen, first = await _start(state, prompt, params, media_param="prompt")
    except OpenAIError as e:
        return e.response()
    echo = ""
    if req.echo:
        echo = prompt["prompt"] if "prompt" in prompt else state.engine.tokenizer.decode(prompt["prompt_token_ids"])
    ctx = _Context(new_id("cmpl"), now(), req.model, req.logprobs is not None, echo)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _SSEResponse(_completion_events(gen, first, ctx, include_usage))
    try:
        out = await _collect(request, gen, first)
    except OpenAIError as e:
        return e.response()
    comp = out.outputs[0]
    logprobs = _completion_logprobs(comp.logprobs, len(echo)) if ctx.logprobs else None
    body = CompletionResponse(id=ctx.id, created=ctx.created, model=req.model, usage=_usage(out),
                              choices=[CompletionChoice(text=echo + comp.text, logprobs=logprobs,
                                                        finish_reason=comp.finish_reason)])
    return JSONResponse(body.model_dump(mode="json"))


# ---- request -> prompt + SamplingParams ----------------------------------------------------

def _state(request: Request) -> ServerState:
    return request.app.state.mm


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(exc: ValidationError) -> OpenAIError:
    """One 400 naming the most specific failing parameter (union branches add noise otherwise)."""
    errors = [(_clean_loc(err["loc"]), err["msg"]) for err in exc.errors()]
    # drop an error when another one points deeper into the same value
    kept = [(loc, msg) for loc, msg in errors
            if not any(len(other) > len(loc) and other[:len(loc)] == loc for other, _ in errors)]
    seen: set[str] = set()
    parts = []
    for loc, msg in kept:
        text = f"{_param_name(loc)}: {msg}" if loc else msg
        if text not in seen:
            seen.add(text)
            parts.append(text)
    return OpenAIError(400, "; ".join(parts) or "invalid request", param=_param_name(kept[0][0]) if kept else None)


def _clean_loc(loc: tuple) -> tuple:
    """Drop pydantic's union-branch markers such as 'str' or 'list[tagged-union[...]]' from a location."""
    keep = []
    for part in loc:
        if isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict")
                                      or part[:1].isupper()):
            continue
        keep.append(part)
    return tuple(keep)


def _param_name(loc: tuple) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def _check_model(state: ServerState, name: str) -> None:
    if not state.has_model(name):
        raise OpenAIError(404, f"The model `{name}` does not exist. Served models: {', '.join(state.model_names)}",
                          param="model", code="model_not_found")


def _unsupported(value: Any, param: str, what: str) -> None:
    if value:
        raise OpenAIError(400, f"{param}: {what} is not supported by this server", param=param)


def _common_kwargs(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    _unsupported(req.logit_bias, "logit_bias", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    kw: dict[str, Any] = dict(
        n=req.n, seed=req.seed, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        stop=req.stop, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids or [], include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    return kw


def _sampling_params(kw: dict[str, Any], param_names: dict[str, str]) -> SamplingParams:
    """SamplingParams(**kw); its ValueError becomes a 400 naming the OpenAI parameter."""
    try:
        return SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        field = str(e).split(" ", 1)[0]
        raise OpenAIError(400, str(e), param=param_names.get(field, field)) from None


def _default_max_tokens(state: ServerState) -> int:
    return state.engine.engine.max_model_len  # the engine clamps it to what is left after the prompt


def _chat_params(req: ChatCompletionRequest, state: ServerState) -> SamplingParams:
    _unsupported(req.tools, "tools", "tool calling")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise OpenAIError(400, "response_format: only {'type': 'text'} is supported", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    kw = _common_kwargs(req)
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw["max_tokens"] = given if given is not None else _default_max_tokens(state)
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
             "logprobs": "top_logprobs"}
    return _sampling_params(kw, names)


def _completion_params(req: CompletionRequest, state: ServerState) -> SamplingParams:
    _unsupported(req.suffix, "suffix", "suffix")
    if req.best_of not in (None, 1):
        raise OpenAIError(400, f"best_of must be 1, got {req.best_of}", param="best_of")
    if req.echo and req.logprobs is not None:
        raise OpenAIError(400, "echo together with logprobs (prompt logprobs) is not supported", param="echo")
    kw = _common_kwargs(req)
    kw["max_tokens"] = req.max_tokens if req.max_tokens is not None else _default_max_tokens(state)
    kw["logprobs"] = req.logprobs
    return _sampling_params(kw, {})


def _chat_prompt(req: ChatCompletionRequest, state: ServerState) -> dict[str, Any]:
    try:
        prompt = state.engine.engine.inputs.apply_chat_template([m.to_template() for m in req.messages])
    except (ValueError, TypeError) as e:
        raise OpenAIError(400, f"messages: {e}", param="messages") from None
    except Exception as e:  # jinja2 TemplateError and the like: the template rejected these messages
        raise OpenAIError(400, f"messages: the chat template cannot render these messages: {e}",
                          param="messages") from None
    return prompt


def _completion_prompt(req: CompletionRequest) -> dict[str, Any]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(400, f"prompt: one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    return {"prompt_token_ids": list(prompt)}


# ---- running a request ---------------------------------------------------------------------

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


@dataclass
class _Context:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str
    logprobs: bool
    echo: str = ""         # completions with echo: the prompt text, sent first


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


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


async def _chat_events(gen: AsyncIterator[RequestOutput], first: RequestOutput, ctx: _Context,
                       include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: Delta, logprobs: list | None = None, finish: str | None = None) -> str:
        lp = ChatLogprobs(content=_chat_logprobs(logprobs)) if ctx.logprobs and logprobs is not None else None
        return _sse(ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[
            ChatChunkChoice(delta=delta, logprobs=lp, finish_reason=finish)]))

    errors: list[OpenAIError] = []
    async with contextlib.aclosing(gen):
        yield chunk(Delta(role="assistant", content=""))
        last = first
        async for out, text, lps in _deltas(gen, first, errors.append):
            last = out
            if text or lps:
                yield chunk(Delta(content=text), lps)
        if errors:
            yield _sse(errors[0].body())
        else:
            yield chunk(Delta(), finish=last.outputs[0].finish_reason)
            if include_usage:
                yield _sse(ChatCompletionChunk(id=ctx.id, created=ctx.created, model=ctx.model, choices=[],
                                               usage=_usage(last)))
    yield "data: [DONE]\n\n"


async def _completion_events(gen: AsyncIterator[RequestOutput], first: RequestOutput, ctx: _Context,
                             include_usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, logprobs: CompletionLogprobs | None = None, finish: str | None = None,
              usage: Usage | None = None) -> str:
        choices = [] if usage is not None else [CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish)]
        return _sse(CompletionResponse(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                                       usage=usage))

    errors: list[OpenAIError] = []
    async with contextlib.aclosing(gen):
        offset = len(ctx.echo)
        if ctx.echo:
            yield chunk(ctx.echo)
        last = first
        async for out, text, lps in _deltas(gen, first, errors.append):
            last = out
            if text or lps:
                logprobs = _completion_logprobs(lps, offset) if ctx.logprobs else None
                offset += sum(len(t) for t in logprobs.tokens) if logprobs else 0
                yield chunk(text, logprobs)
        if errors:
            yield _sse(errors[0].body())
        else:
            yield chunk("", finish=last.outputs[0].finish_reason)
            if include_usage:
                yield chunk("", usage=_usage(last))
    yield "data: [DONE]\n\n"


# ---- output formatting ---------------------------------------------------------------------

def _usage(out: RequestOutput) -> Usage:
    prompt = len(out.prompt_token_ids)
    completion = len(out.outputs[0].token_ids)
    cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _ranked(entry: dict[int, Logprob]) -> tuple[Logprob, list[Logprob]]:
    """(chosen token, top-k in rank order) of one engine logprob entry; the chosen id is the first key."""
    chosen = next(iter(entry.values()))
    top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return chosen, top


def _token_text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _chat_logprobs(entries: list[dict[int, Logprob]] | None) -> list[TokenLogprob]:
    result = []
    for entry in entries or []:
        chosen, top = _ranked(entry)
        result.append(TokenLogprob(
            token=_token_text(chosen), logprob=chosen.logprob, bytes=list(_token_text(chosen).encode()),
            top_logprobs=[TopLogprob(token=_token_text(t), logprob=t.logprob, bytes=list(_token_text(t).encode()))
                          for t in top]))
    return result


def _completion_logprobs(entries: list[dict[int, Logprob]] | None, offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for entry in entries or []:
        chosen, top = _ranked(entry)
        token = _token_text(chosen)
        result.tokens.append(token)
        result.token_logprobs.append(chosen.logprob)
        top_map: dict[str, float] = {}
        for t in top:  # several ids can decode to the same text (byte tokens); keep the likeliest
            top_map.setdefault(_token_text(t), t.logprob)
        result.top_logprobs.append(top_map)
        result.text_offset.append(offset)
        offset += len(token)
    return result

