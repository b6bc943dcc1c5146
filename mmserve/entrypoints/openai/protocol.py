"""Pydantic models of the OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

Request models check types only; value ranges are checked once, by SamplingParams, and the routes in
api.py name the OpenAI parameter in the 400. Response models follow OpenAI's JSON field for field.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from mmserve.entrypoints.json_wire import JSONFloat


def _none(value: Any) -> bool:
    return value is None


class _Request(BaseModel):
    # Unknown keys are ignored (as OpenAI-compatible servers do), so newer SDKs keep working.
    model_config = ConfigDict(extra="ignore")


# ---- requests ------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool = False


class ImageURL(_Request):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL | str


class VideoURL(_Request):
    url: str


class VideoPart(_Request):
    """vLLM-style extension: a video by URL or data URI (frames sampled server-side)."""

    type: Literal["video_url"]
    video_url: VideoURL | str


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as InputProcessor.apply_chat_template takes it."""
        if self.content is None or isinstance(self.content, str):
            return {"role": self.role, "content": self.content or ""}
        parts: list[dict[str, Any]] = []
        for p in self.content:
            if isinstance(p, TextPart):
                parts.append({"type": "text", "text": p.text})
            elif isinstance(p, VideoPart):
                url = p.video_url if isinstance(p.video_url, str) else p.video_url.url
                parts.append({"type": "video_url", "video_url": {"url": url}})
            else:
                url = p.image_url if isinstance(p.image_url, str) else p.image_url.url
                parts.append({"type": "image_url", "image_url": {"url": url}})
        return {"role": self.role, "content": parts}


class _SamplingFields(_Request):
    """Fields shared by chat and completions: OpenAI's, then vLLM-style extras."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt | None = 1  # choices; null = 1 (requests.num_choices checks the range)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras (vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided_json: str | dict[str, Any] | None = None  # a JSON schema the output follows
    guided_regex: str | None = None
    guided_grammar: str | None = None  # an EBNF (GBNF) grammar
    prompt_logprobs: int | None = None  # each prompt token's logprob + the top k (not with stream)
    use_beam_search: bool = False  # the n choices are the n best beams (not with stream)
    length_penalty: float = (
        1.0  # beam search: a hypothesis scores sum(logprobs) / length ** length_penalty
    )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


# ---- responses -----------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: JSONFloat
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class PromptLogprob(BaseModel):
    logprob: JSONFloat
    rank: int | None = None
    decoded_token: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's shape: None for the first prompt token, then {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, exclude_if=_none
    )


class Delta(BaseModel):
    role: str | None = Field(default=None, exclude_if=_none)
    content: str | None = Field(default=None, exclude_if=_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=_none)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[JSONFloat | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, JSONFloat] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None, exclude_if=_none
    )


class CompletionResponse(BaseModel):
    """Also the shape of each streamed chunk (OpenAI streams `text_completion` objects)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "mmserve"
    parent: str | None = None  # a LoRA adapter's base model (left out for the base model names)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
