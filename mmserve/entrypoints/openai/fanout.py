"""OpenAI's `n`: one engine request per choice, all or nothing.

`start_choices` queues one request per choice of the same prompt (choice i seeded `seed + i` when a seed is
given) and waits for each one's first output; `finish_choices` runs them to their ends (streams.py `merge`
interleaves their streams). A failure of any choice, an overloaded server or a cancel (the client went away)
closes every choice's engine stream, which aborts its request and frees its KV blocks. Copies of one prompt cost
one prefill: the scheduler makes later copies wait for the first and reuse its KV cache.

`start_beam_choices` (vLLM's `use_beam_search`): one beam search whose n best beams are the n choices; each
choice's stream yields its beam once the search ends, and closing any of them (a failure, the client gone)
cancels the search, whose step requests are aborted with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mmserve.core.outputs import RequestOutput
from mmserve.engine.admission import EngineOverloaded
from mmserve.entrypoints.openai.responses import OpenAIError
from mmserve.entrypoints.state import ServerBusy, ServerDraining, ServerState
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# request parameters the engine checks (against the model, or RequestLimits); its messages start with their names
_ENGINE_CHECKED_PARAMS = ("logit_bias", "stop", "stop_token_ids")


@dataclass
class ChoiceRun:
    """One choice's engine request: its output stream and its latest output (the first, to begin with)."""

    index: int
    stream: AsyncIterator[RequestOutput]
    last: RequestOutput


async def start_choices(
    state: ServerState,
    prompt: dict[str, Any],
    params: list[SamplingParams],
    request_id: str,
    media_param: str,
) -> list[ChoiceRun]:
    """Queue one engine request per entry of `params` (ids request_id-0, -1, ...) and wait for every first
    output, so input errors still get their own status code. Raises the first failure as an OpenAIError
    after aborting the requests already started; a cancel aborts them too."""
    if state.engine.dead_error is not None:
        raise OpenAIError(503, f"the engine has stopped: {state.engine.dead_error}", "server_error")
    tasks: list[asyncio.Task] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(_start(state, prompt, p, f"{request_id}-{i}", media_param))
                for i, p in enumerate(params)
            ]
    except BaseException as e:
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result()[0].aclose()
        if isinstance(e, BaseExceptionGroup):
            raise e.exceptions[0] from None
        raise
    return [ChoiceRun(i, *task.result()) for i, task in enumerate(tasks)]


def start_beam_choices(
    state: ServerState,
    prompt: dict[str, Any],
    params: SamplingParams,
    width: int,
    length_penalty: float,
    request_id: str,
) -> list[ChoiceRun]:
    """The `width` choices of one beam search (best first); nothing runs until a choice's stream is read."""
    search: asyncio.Future | None = None

    async def run() -> RequestOutput:
        last = None
        async with contextlib.aclosing(
            state.beam_search(prompt, params, width, length_penalty)
        ) as steps:
            async for last in steps:
                pass
        return last

    async def beam(k: int) -> AsyncIterator[RequestOutput]:
        nonlocal search
        search = search or asyncio.ensure_future(run())
        try:
            out = await search
            yield RequestOutput(
                out.request_id,
                out.prompt,
                out.prompt_token_ids,
                [dataclasses.replace(out.outputs[k], index=0)],
                True,
                out.metrics,
            )
        finally:
            if not search.done():
                search.cancel()

    waiting = RequestOutput(request_id, None, [], [], False)  # `last` until the search ends
    return [ChoiceRun(k, beam(k), waiting) for k in range(width)]


async def _start(
    state: ServerState,
    prompt: dict[str, Any],
    params: SamplingParams,
    request_id: str,
    media_param: str,
) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
    gen = state.generate(prompt, params, request_id)
    try:
        first = await anext(gen)
    except BaseException as e:
        await gen.aclose()
        if isinstance(e, Exception):
            raise engine_error(e, media_param) from None
        raise
    return gen, first


def engine_error(e: Exception, media_param: str) -> OpenAIError:
    """The OpenAI answer to an exception out of ServerState.generate."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ServerDraining):
        return OpenAIError(503, str(e), "server_error", code="server_shutting_down")
    if isinstance(e, (ServerBusy, EngineOverloaded)):
        return OpenAIError(
            503, f"the server is overloaded: {e}", "server_error", code="server_overloaded"
        )
    if isinstance(e, (ValueError, TypeError)):
        # prompt / media problems; the message names the field (e.g. "images[0]: ..."), or a request parameter
        # the engine checks against the model (e.g. "logit_bias: token id ... is outside the vocabulary")
        head = str(e).split(":", 1)[0]
        return OpenAIError(
            400, str(e), param=head if head in _ENGINE_CHECKED_PARAMS else media_param
        )
    logger.error("request failed: %s: %s", type(e).__name__, e)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def finish_choices(runs: list[ChoiceRun]) -> None:
    """Run every choice to its final output (left in run.last). The first failure, as an OpenAIError, aborts
    the other choices; a cancel aborts them all."""

    async def finish(run: ChoiceRun) -> None:
        async for out in run.stream:
            run.last = out

    try:
        async with asyncio.TaskGroup() as group:
            for run in runs:
                group.create_task(finish(run))
    except BaseExceptionGroup as e:
        raise engine_error(e.exceptions[0], "messages") from None
    finally:
        await close_choices(runs)


async def close_choices(runs: list[ChoiceRun]) -> None:
    """Close every choice's stream: a finished one is left as it is, an unfinished one's request is aborted."""
    for run in runs:
        if not getattr(
            run.stream, "ag_running", False
        ):  # a running one is in a cancelled task, closing now
            await run.stream.aclose()
