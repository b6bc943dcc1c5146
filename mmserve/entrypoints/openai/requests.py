"""OpenAI request -> engine prompt + SamplingParams: body parsing, validation and parameter mapping.

Every problem is raised as an OpenAIError 400 (404 for an unknown model) naming the OpenAI parameter.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from mmserve.engine.beam_search import MAX_BEAM_WIDTH, check_length_penalty, unsupported_with_beams
from mmserve.entrypoints.json_wire import loads_object
from mmserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from mmserve.entrypoints.openai.responses import OpenAIError
from mmserve.entrypoints.state import ServerState
from mmserve.sampling_params import SamplingParams

# Most choices (`n`) one request may ask for. Each choice is its own engine request (fanout.py), so one
# HTTP request holds up to this many of the server's --max-concurrent-requests slots and decode rows.
MAX_CHOICES = 16


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    try:
        body = loads_object(await request.body())
    except ValueError as e:
        raise OpenAIError(400, str(e)) from None
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(exc: ValidationError) -> OpenAIError:
    """One 400 naming the most specific failing parameter (union branches add noise otherwise)."""
    errors = [(_clean_loc(err["loc"]), err["msg"]) for err in exc.errors()]
    # drop an error when another one points deeper into the same value
    kept = [
        (loc, msg)
        for loc, msg in errors
        if not any(len(other) > len(loc) and other[: len(loc)] == loc for other, _ in errors)
    ]
    seen: set[str] = set()
    parts = []
    for loc, msg in kept:
        text = f"{_param_name(loc)}: {msg}" if loc else msg
        if text not in seen:
            seen.add(text)
            parts.append(text)
    return OpenAIError(
        400, "; ".join(parts) or "invalid request", param=_param_name(kept[0][0]) if kept else None
    )


def _clean_loc(loc: tuple) -> tuple:
    """Drop pydantic's union-branch markers such as 'str' or 'list[tagged-union[...]]' from a location."""
    keep = []
    for part in loc:
        if isinstance(part, str) and (
            "[" in part
            or part in ("str", "int", "float", "bool", "list", "dict")
            or part[:1].isupper()
        ):
            continue
        keep.append(part)
    return tuple(keep)


def _param_name(loc: tuple) -> str:
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def check_model(state: ServerState, name: str) -> None:
    if not state.has_model(name):
        raise OpenAIError(
            404,
            f"The model `{name}` does not exist. Served models: {', '.join(state.model_names)}",
            param="model",
            code="model_not_found",
        )


def _unsupported(value: Any, param: str, what: str) -> None:
    if value:
        raise OpenAIError(400, f"{param}: {what} is not supported by this server", param=param)


def num_choices(req: ChatCompletionRequest | CompletionRequest) -> int:
    """The request's `n` (null means 1), checked to be in [1, MAX_CHOICES]."""
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_CHOICES:
        raise OpenAIError(400, f"n must be an integer in [1, {MAX_CHOICES}], got {n}", param="n")
    return n


def beam_width_of(
    req: ChatCompletionRequest | CompletionRequest, params: SamplingParams, n: int
) -> int:
    """`use_beam_search`: the width (= n, the request's checked `n`, at most MAX_BEAM_WIDTH); 0 when not asked.
    400s name the parameter beam search cannot take yet."""
    if not req.use_beam_search:
        return 0
    if n > MAX_BEAM_WIDTH:
        raise OpenAIError(
            400, f"n must be at most {MAX_BEAM_WIDTH} with use_beam_search, got {n}", param="n"
        )
    if req.stream:
        raise OpenAIError(
            400, "use_beam_search is not supported with stream", param="use_beam_search"
        )
    try:
        check_length_penalty(req.length_penalty)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="length_penalty") from None
    field = unsupported_with_beams(params)
    if field is not None:
        raise OpenAIError(400, f"{field} is not supported with use_beam_search yet", param=field)
    return n


def _logit_bias(given: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON keys, so strings) to biases in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (given or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise OpenAIError(
                400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not -100 <= value <= 100
        ):
            raise OpenAIError(
                400,
                f"logit_bias: the bias of token {key} must be a number in [-100, 100], "
                f"got {value!r}",
                param="logit_bias",
            )
        out[tok] = float(value)
    return out


async def _guided(
    req: ChatCompletionRequest | CompletionRequest, state: ServerState
) -> dict[str, Any]:
    """The guided-decoding kwargs of vLLM's extras guided_json / guided_regex / guided_grammar, and of a chat
    request's response_format (json_object: any JSON object; json_schema: its `schema`); the guide is compiled
    here, on a worker thread (a large schema's first compile takes a while; the engine reuses it), so a bad one
    is a 400 naming the field it came in."""
    given = [
        (name, value)
        for name, value in (
            ("guided_json", req.guided_json),
            ("guided_regex", req.guided_regex),
            ("guided_grammar", req.guided_grammar),
        )
        if value is not None
    ]
    fmt = getattr(req, "response_format", None) or {}
    if fmt.get("type") not in (None, "text"):
        given.append(("response_format", fmt))
    if len(given) > 1:
        raise OpenAIError(
            400,
            f"{given[1][0]}: only one of guided_json, guided_regex, guided_grammar and "
            "response_format may constrain the output",
            param=given[1][0],
        )
    if not given:
        return {}
    name, value = given[0]
    if name == "guided_regex":
        kind, guide = "regex", value
    elif name == "guided_grammar":
        kind, guide = "ebnf_grammar", value
    elif name == "guided_json":
        kind, guide = "json_schema", value if isinstance(value, str) else json.dumps(value)
    elif value["type"] == "json_object":
        kind, guide = "json_schema", '{"type": "object"}'
    else:
        wrapper = value.get("json_schema") if value["type"] == "json_schema" else None
        schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(
                400,
                "response_format: expected {'type': 'text' | 'json_object'} or {'type': "
                "'json_schema', 'json_schema': {'schema': {...}}}",
                param="response_format",
            )
        kind, guide = "json_schema", json.dumps(schema)
    try:
        await state.engine.compile_guide(kind, guide)
    except ValueError as e:
        raise OpenAIError(400, f"{name}: {str(e).split(': ', 1)[-1]}", param=name) from None
    return {"guided_decoding_type": kind, "guided_decoding_guide": guide}


def _common_kwargs(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise OpenAIError(
            400, "prompt_logprobs is not supported with stream", param="prompt_logprobs"
        )
    kw: dict[str, Any] = dict(  # n stays 1: each choice is its own engine request
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        stop=req.stop,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=req.stop_token_ids or [],
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=_logit_bias(req.logit_bias),
        prompt_logprobs=req.prompt_logprobs,
    )
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
    """max_model_len: the engine clamps it to what is left after the prompt."""
    return state.engine.model_info.max_model_len


async def chat_params(req: ChatCompletionRequest, state: ServerState) -> SamplingParams:
    _unsupported(req.tools, "tools", "tool calling")
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    kw = {**_common_kwargs(req), **await _guided(req, state)}
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    kw["max_tokens"] = given if given is not None else _default_max_tokens(state)
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    names = {
        "max_tokens": "max_completion_tokens"
        if req.max_completion_tokens is not None
        else "max_tokens",
        "logprobs": "top_logprobs",
    }
    return _sampling_params(kw, names)


async def completion_params(req: CompletionRequest, state: ServerState) -> SamplingParams:
    _unsupported(req.suffix, "suffix", "suffix")
    if req.best_of not in (None, 1):
        raise OpenAIError(400, f"best_of must be 1, got {req.best_of}", param="best_of")
    kw = {**_common_kwargs(req), **await _guided(req, state)}
    kw["max_tokens"] = req.max_tokens if req.max_tokens is not None else _default_max_tokens(state)
    kw["logprobs"] = req.logprobs
    if (
        req.echo and req.logprobs is not None
    ):  # the echoed prompt's tokens come with their logprobs too
        kw["prompt_logprobs"] = max(req.logprobs, req.prompt_logprobs or 0)
    return _sampling_params(kw, {})


def chat_prompt(messages: list[ChatMessage], state: ServerState) -> dict[str, Any]:
    """The prompt dict the model's chat template makes of `messages`; 400s name `messages`."""
    try:
        prompt = state.engine.apply_chat_template([m.to_template() for m in messages])
    except (ValueError, TypeError) as e:
        raise OpenAIError(400, f"messages: {e}", param="messages") from None
    except (
        Exception
    ) as e:  # jinja2 TemplateError and the like: the template rejected these messages
        raise OpenAIError(
            400, f"messages: the chat template cannot render these messages: {e}", param="messages"
        ) from None
    return prompt


def with_lora(prompt: dict[str, Any], model: str, state: ServerState) -> dict[str, Any]:
    """The prompt with the LoRA adapter the request's `model` names, if it names one."""
    return {**prompt, "lora": model} if model in state.lora_names else prompt


def completion_prompt(req: CompletionRequest) -> dict[str, Any]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(
                400,
                f"prompt: one prompt per request is supported, got {len(prompt)}",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not prompt:
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    return {"prompt_token_ids": list(prompt)}
