"""Pure building of OpenAI answers from engine outputs: error bodies, response bodies, SSE stream chunks,
usage and logprobs. No I/O and no engine calls; api.py runs the requests and sends these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from mmserve.core.outputs import Logprob, RequestOutput
from mmserve.entrypoints.json_wire import WireJSONResponse, dumps
from mmserve.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    ErrorInfo,
    ErrorResponse,
    PromptLogprob,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mmserve.entrypoints.request_ids import log_client_error

_RETRY_AFTER_S = "1"


class OpenAIError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> WireJSONResponse:
        if 400 <= self.status < 500:
            log_client_error(self.status, self.message)
        headers = {"Retry-After": _RETRY_AFTER_S} if self.status == 503 else None
        return WireJSONResponse(self.body(), status_code=self.status, headers=headers)


def edge_error_response(
    path: str, status: int, message: str, openai_type: str = "invalid_request_error"
) -> WireJSONResponse:
    """An error answered outside the routes (a middleware's): OpenAI's shape on the routes that answer in it (/v1/,
    /tokenize, /detokenize), Triton's `{"error": message}` on the others."""
    if path.startswith(("/v1/", "/tokenize", "/detokenize")):
        return OpenAIError(status, message, openai_type).response()
    return WireJSONResponse({"error": message}, status_code=status)


@dataclass
class ResponseContext:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str
    logprobs: bool
    echo: str = ""  # completions with echo: the prompt text, sent first
    echo_logprobs: CompletionLogprobs | None = (
        None  # echo with logprobs: the prompt tokens' (prompt_logprobs)
    )


# ---- whole (non-streamed) responses --------------------------------------------------------


def chat_response(ctx: ResponseContext, outs: list[RequestOutput]) -> ChatCompletionResponse:
    """The whole answer; outs[i] is the final output of choice i."""
    choices = []
    for i, out in enumerate(outs):
        comp = out.outputs[0]
        logprobs = ChatLogprobs(content=chat_logprobs(comp.logprobs)) if ctx.logprobs else None
        choices.append(
            ChatChoice(
                index=i,
                message=AssistantMessage(content=comp.text),
                logprobs=logprobs,
                finish_reason=comp.finish_reason,
            )
        )
    return ChatCompletionResponse(
        id=ctx.id,
        created=ctx.created,
        model=ctx.model,
        choices=choices,
        usage=usage_of(outs),
        prompt_logprobs=prompt_logprobs(outs[0]),
    )


def completion_response(ctx: ResponseContext, outs: list[RequestOutput]) -> CompletionResponse:
    """The whole answer; outs[i] is the final output of choice i (each choice starts with the echo)."""
    choices = []
    for i, out in enumerate(outs):
        comp = out.outputs[0]
        logprobs = completion_logprobs(comp.logprobs, len(ctx.echo)) if ctx.logprobs else None
        if logprobs is not None and ctx.echo_logprobs is not None:
            logprobs = joined(ctx.echo_logprobs, logprobs)
        choices.append(
            CompletionChoice(
                index=i,
                text=ctx.echo + comp.text,
                logprobs=logprobs,
                finish_reason=comp.finish_reason,
                prompt_logprobs=prompt_logprobs(out),
            )
        )
    return CompletionResponse(
        id=ctx.id, created=ctx.created, model=ctx.model, usage=usage_of(outs), choices=choices
    )


# ---- stream chunks (SSE events) ------------------------------------------------------------


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else dumps(obj).decode()
    return f"data: {data}\n\n"


def chat_chunk(
    ctx: ResponseContext,
    delta: Delta,
    logprobs: list | None = None,
    finish: str | None = None,
    usage: Usage | None = None,
    index: int = 0,
) -> str:
    """One chat.completion.chunk event of choice `index`; with usage, the final usage-only chunk (no choices)."""
    if usage is not None:
        return sse(
            ChatCompletionChunk(
                id=ctx.id, created=ctx.created, model=ctx.model, choices=[], usage=usage
            )
        )
    lp = (
        ChatLogprobs(content=chat_logprobs(logprobs))
        if ctx.logprobs and logprobs is not None
        else None
    )
    return sse(
        ChatCompletionChunk(
            id=ctx.id,
            created=ctx.created,
            model=ctx.model,
            choices=[ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)],
        )
    )


def completion_chunk(
    ctx: ResponseContext,
    text: str,
    logprobs: CompletionLogprobs | None = None,
    finish: str | None = None,
    usage: Usage | None = None,
    index: int = 0,
) -> str:
    """One text_completion event of choice `index`; with usage, the final usage-only chunk (no choices)."""
    choices = (
        []
        if usage is not None
        else [CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)]
    )
    return sse(
        CompletionResponse(
            id=ctx.id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )
    )


# ---- usage and logprobs --------------------------------------------------------------------


def usage_of(outs: list[RequestOutput]) -> Usage:
    """Usage of one response whose choices are `outs` (one engine request each, same prompt): the prompt
    counted once, as OpenAI does, its cached tokens those no choice had to compute (the fewest), the
    completion tokens summed over the choices."""
    prompt = len(outs[0].prompt_token_ids)
    completion = sum(len(out.outputs[0].token_ids) for out in outs)
    cached = min(out.metrics.num_cached_tokens if out.metrics is not None else 0 for out in outs)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _ranked(entry: dict[int, Logprob]) -> tuple[Logprob, list[Logprob]]:
    """(chosen token, top-k in rank order) of one engine logprob entry; the chosen id is the first key."""
    chosen = next(iter(entry.values()))
    top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
    return chosen, top


def _token_text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def chat_logprobs(entries: list[dict[int, Logprob]] | None) -> list[TokenLogprob]:
    result = []
    for entry in entries or []:
        chosen, top = _ranked(entry)
        result.append(
            TokenLogprob(
                token=_token_text(chosen),
                logprob=chosen.logprob,
                bytes=list(_token_text(chosen).encode()),
                top_logprobs=[
                    TopLogprob(
                        token=_token_text(t), logprob=t.logprob, bytes=list(_token_text(t).encode())
                    )
                    for t in top
                ],
            )
        )
    return result


def completion_logprobs(
    entries: list[dict[int, Logprob]] | None, offset: int
) -> CompletionLogprobs:
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


def prompt_logprobs(out: RequestOutput) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: logprob, rank, decoded token}."""
    if out.prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(tok): PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token
            )
            for tok, lp in entry.items()
        }
        for entry in out.prompt_logprobs
    ]


def echo_logprobs(out: RequestOutput, decode: Callable[[list[int]], str]) -> CompletionLogprobs:
    """The echoed prompt's part of a completion's logprobs: each prompt token with its logprob and top
    logprobs (None for the first token, which nothing predicts), offsets from the start of the text."""
    first = decode([out.prompt_token_ids[0]])
    rest = completion_logprobs(out.prompt_logprobs[1:], len(first))
    return CompletionLogprobs(
        tokens=[first, *rest.tokens],
        token_logprobs=[None, *rest.token_logprobs],
        top_logprobs=[None, *rest.top_logprobs],
        text_offset=[0, *rest.text_offset],
    )


def joined(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )
