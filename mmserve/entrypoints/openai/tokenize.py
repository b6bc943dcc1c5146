"""`/tokenize` and `/detokenize` (vLLM's routes, beside the OpenAI API): the served model's tokenizer over HTTP, for
clients of the token-level `tensorrt_llm` Triton model and for counting tokens. Text (or chat messages through the
model's chat template) to ids and back; image placeholders stay single ids (the processor expands them per picture
when a request carries the pictures). Errors are OpenAI-shaped 400s naming the field."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, StrictInt

from mmserve.entrypoints.json_wire import WireJSONResponse
from mmserve.entrypoints.openai.openapi import DETOKENIZE_RESPONSE, TOKENIZE_RESPONSE, openai_route
from mmserve.entrypoints.openai.protocol import ChatMessage
from mmserve.entrypoints.openai.requests import chat_prompt, check_model, parse_body
from mmserve.entrypoints.openai.responses import OpenAIError
from mmserve.entrypoints.state import ServerState

router = APIRouter()


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = (
        None  # instead of prompt: rendered with the chat template first
    )
    add_special_tokens: bool = True  # prompt only: the template writes its own


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[StrictInt]


async def _parsed(request: Request, body_type: type[BaseModel]) -> tuple[ServerState, Any]:
    """The server state and the validated body; its `model`, when given, must be served."""
    state: ServerState = request.app.state.mm
    req = await parse_body(request, body_type)
    if req.model is not None:
        check_model(state, req.model)
    return state, req


@router.post("/tokenize", **openai_route(TokenizeRequest, TOKENIZE_RESPONSE))
async def tokenize(request: Request) -> Response:
    try:
        state, req = await _parsed(request, TokenizeRequest)
        ids = _ids(state, req)
    except OpenAIError as e:
        return e.response()
    return WireJSONResponse(
        {"tokens": ids, "count": len(ids), "max_model_len": state.engine.model_info.max_model_len}
    )


@router.post("/detokenize", **openai_route(DetokenizeRequest, DETOKENIZE_RESPONSE))
async def detokenize(request: Request) -> Response:
    try:
        state, req = await _parsed(request, DetokenizeRequest)
        vocab = state.engine.model_info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                400, f"tokens: {bad[0]} is outside the vocabulary (size {vocab})", param="tokens"
            )
    except OpenAIError as e:
        return e.response()
    return WireJSONResponse({"prompt": state.engine.tokenizer.decode(req.tokens)})


def _ids(state: ServerState, req: TokenizeRequest) -> list[int]:
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "give exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        return state.engine.tokenizer(
            req.prompt, add_special_tokens=req.add_special_tokens
        ).input_ids
    # the template already wrote the special tokens it wants
    return state.engine.tokenizer(
        chat_prompt(req.messages, state)["prompt"], add_special_tokens=False
    ).input_ids
