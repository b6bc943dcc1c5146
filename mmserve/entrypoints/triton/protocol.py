"""The text models' mapping from Triton tensors to mmserve requests, shared by KServe REST, the generate extension
and gRPC (they differ only in framing): input tensors -> TritonRequest (prompt dict + SamplingParams + options),
PROTOCOL §1, §4. Every bad input raises ValueError naming the tensor. The token-level `tensorrt_llm` model's inputs
are `tokens.py`'s, what every model reads alike `requests.py`'s; running the requests is `run.py`, the output
tensors are built by `outputs.py`. Picture inputs are loaded here, by `mmserve.multimodal.inputs` (the loader
the engine's input processor runs for the other APIs), under the server's MediaConfig."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from mmserve.engine.admission import EngineOverloaded
from mmserve.engine.async_engine import EngineStopped
from mmserve.engine.beam_search import check_length_penalty
from mmserve.entrypoints.state import ServerBusy, ServerState
from mmserve.entrypoints.triton.models import (
    ACCEPTED_INPUTS,
    ALIASES,
    BLS,
    ENSEMBLE,
    MODEL_VERSION,
    TRTLLM,
    TRTLLM_INPUTS,
)
from mmserve.entrypoints.triton.prompts import build_prompt
from mmserve.entrypoints.triton.requests import (
    BatchItem,
    TritonRequest,
    beam_width,
    check_tensor,
    guided_params,
    lora_name,
    num_return_sequences,
)
from mmserve.entrypoints.triton.tensors import image_arrays, pixel_values
from mmserve.entrypoints.triton.tokens import parse_token_request
from mmserve.multimodal.prompt_media import MEDIA_FIELD
from mmserve.sampling_params import SamplingParams

IMAGE_INPUTS = ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")
UNSUPPORTED_INPUTS = ("prompt_embedding_table", "prompt_vocab_size", "num_draft_tokens")


class ModelNotFound(LookupError):
    """Unknown model name or version: HTTP 404 / gRPC NOT_FOUND."""


def check_model(state: ServerState, model: str, version: str = "") -> None:
    if not state.has_model(model):
        raise ModelNotFound(f"Request for unknown model: '{model}' is not found")
    if version not in ("", MODEL_VERSION):
        raise ModelNotFound(f"Request for unknown model: '{model}' version {version} is not found")


def http_status(exc: BaseException) -> int:
    """Triton's error -> HTTP status map (PROTOCOL §2.3) for the exceptions mmserve raises."""
    if isinstance(exc, ModelNotFound):
        return 404
    if isinstance(exc, (ServerBusy, EngineOverloaded, EngineStopped)):
        return 503
    if isinstance(exc, (ValueError, TypeError)):
        return 400
    return 500


async def parse_request(
    state: ServerState, model: str, tensors: dict[str, np.ndarray], client_id: str = ""
) -> list[TritonRequest]:
    """Input tensors (full shapes, batch first) -> one TritonRequest per batch item. Empty tensors count as
    absent (clients send them for unused optional inputs). `client_id`: the request's Triton `id`."""
    if model == TRTLLM:  # token ids in, token ids out
        reqs = await parse_token_request(state, tensors)
    else:
        reqs = await _parse_text_request(state, model, tensors)
    if any(r.cancel for r in reqs) and not client_id:
        raise ValueError("stop: cancelling needs the request id of the requests to stop")
    return [dataclasses.replace(r, client_id=client_id) for r in reqs]


async def _parse_text_request(
    state: ServerState, model: str, tensors: dict[str, np.ndarray]
) -> list[TritonRequest]:
    for old, new in ALIASES.items():
        if old in tensors:
            if new in tensors:
                raise ValueError(f"{old}: give either {old} or {new}, not both")
            tensors = {(new if k == old else k): v for k, v in tensors.items()}
    present = {k: v for k, v in tensors.items() if v.size > 0}
    for name in tensors:
        if name not in ACCEPTED_INPUTS:
            raise ValueError(f"unexpected inference input '{name}' for model '{model}'")
    if "text_input" not in present:
        raise ValueError("text_input is required")
    batch = (
        present["text_input"].shape[0] if present["text_input"].ndim else 0
    )  # 0-d: a shape error below
    limit = state.config.max_batch_size  # what the model config reports (--max-num-seqs)
    if batch > limit:
        raise ValueError(
            f"text_input: batch size {batch} exceeds the model's max_batch_size {limit}"
        )
    for name, arr in present.items():
        check_tensor(model, name, arr, batch)
    return [await _parse_item(state, model, BatchItem(present, b)) for b in range(batch)]


def _sampling_params(model: str, g: BatchItem) -> SamplingParams:
    max_tokens = g.scalar("max_tokens")
    if max_tokens is None and model in (ENSEMBLE, BLS):
        raise ValueError("max_tokens is required")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be a single value > 0, got {max_tokens}")
    for name in UNSUPPORTED_INPUTS:
        if name in g.tensors and any(
            g.strings(name) if g.tensors[name].dtype == np.object_ else [1]
        ):
            raise ValueError(f"{name}: this input is not supported yet by mmserve")
    kw: dict[str, Any] = {"include_stop_str_in_output": True}  # TensorRT-LLM keeps the stop word
    for name in ("return_context_logits", "return_generation_logits"):
        kw[name] = bool(g.scalar(name, False))
    if max_tokens is not None:
        kw["max_tokens"] = int(max_tokens)
    for name in ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        if (v := g.scalar(name)) is not None:
            kw[name] = float(v)
    for name in ("top_k", "min_tokens", "seed"):
        if (v := g.scalar(name)) is not None:
            kw[name] = int(v)
    kw.update(guided_params(g))
    top_p = g.scalar("top_p")
    if top_p is not None:
        kw["top_p"] = 1.0 if top_p == 0 else float(top_p)  # TensorRT-LLM: top_p 0 means off
    end_id = g.scalar("end_id")
    if end_id is not None and end_id >= 0:  # the seed client sends -1: the tokenizer's EOS
        kw["eos_token_id"] = int(end_id)
    kw["stop"] = [s for s in g.strings("stop_words") if s]
    kw["bad_words"] = [s for s in g.strings("bad_words") if s]
    if g.scalar("return_log_probs", False):
        kw["logprobs"] = 0
    return SamplingParams(**kw)


async def _parse_item(state: ServerState, model: str, g: BatchItem) -> TritonRequest:
    text = g.strings("text_input")
    if len(text) != 1:
        raise ValueError(f"text_input: expected a single string per batch item, got {len(text)}")
    params = _sampling_params(model, g)
    bias = _embedding_bias(state, g)
    if bias:
        params = dataclasses.replace(params, logit_bias=bias)
    field, prompt, num_images, num_videos = _media(state, g)
    extra_id = g.scalar("prompt_table_extra_id")
    if extra_id is not None and extra_id < 1:
        raise ValueError(f"prompt_table_extra_id must be >= 1, got {extra_id}")
    if extra_id is not None and num_images:
        prompt["image_ids"] = (
            [str(extra_id)] if num_images == 1 else [f"{extra_id}.{k}" for k in range(num_images)]
        )
    if (lora := await lora_name(state, g)) is not None:
        prompt["lora"] = lora
    decoder = g.strings("decoder_text_input")
    if len(decoder) > 1:
        raise ValueError(
            f"decoder_text_input: expected a single string per batch item, got {len(decoder)}"
        )
    if (
        decoder and decoder[0]
    ):  # an encoder-decoder's answer starts with it (TensorRT-LLM's DECODER_QUERY)
        prompt["decoder_prompt"] = decoder[0]
    info = state.engine.model_info
    prompt["prompt"] = build_prompt(
        state.model_type,
        text[0],
        num_images,
        num_videos=num_videos,
        wrap=model in (ENSEMBLE, BLS),
        image_token=info.image_token,
        video_token=info.video_token,
    )
    stream = bool(g.scalar("stream", False))
    width = beam_width(g, params)
    num_return = num_return_sequences(g, width)
    return TritonRequest(
        model,
        prompt,
        params,
        stream=stream,
        exclude_input=g.flag("exclude_input_in_output"),
        return_log_probs=params.logprobs is not None,
        image_field=field,
        beam_width=width,
        length_penalty=check_length_penalty(float(g.scalar("length_penalty", 1.0))),
        num_return=num_return,
    )


def _media(state: ServerState, g: BatchItem) -> tuple[str | None, dict[str, Any], int, int]:
    """The item's picture input, if any: (its name, the prompt keys it fills, images, videos)."""
    given = [name for name in IMAGE_INPUTS if name in g.tensors]
    if len(given) > 1:
        raise ValueError(
            f"only one of {', '.join(IMAGE_INPUTS)} may be given, got {', '.join(given)}"
        )
    if not given:
        return None, {}, 0, 0
    field, media = given[0], state.media
    if field == "image_input":
        pixels = pixel_values(g.tensors[field][g.b])
        if len(pixels) > media.max_images_per_request:
            raise ValueError(
                f"image_input: {len(pixels)} images, max_images_per_request="
                f"{media.max_images_per_request}"
            )
        return field, {"pixel_values": pixels}, len(pixels), 0
    if field == "image_bytes_input":
        sizes = g.tensors["image_sizes_input"][g.b] if "image_sizes_input" in g.tensors else None
        arrays = image_arrays(field, g.tensors[field][g.b], sizes)
        return field, {"images": arrays, MEDIA_FIELD: field}, len(arrays), 0
    if field == "image_url_input":
        urls = g.strings(field)
        if any(not u.strip() for u in urls):
            raise ValueError("image_url_input: empty URL")
        return field, {"images": [u.strip() for u in urls], MEDIA_FIELD: field}, len(urls), 0
    frames = g.tensors[field][
        g.b
    ]  # video_bytes_input: decoded frames [F, H, W, 3] (or [F, 3, H, W])
    if frames.ndim == 4 and frames.shape[-1] != 3 and frames.shape[1] == 3:
        frames = frames.transpose(0, 2, 3, 1)
    return field, {"videos": [np.ascontiguousarray(frames)]}, 0, 1


def _embedding_bias(state: ServerState, g: BatchItem) -> dict[int, float]:
    """TensorRT-LLM's embedding bias: each of embedding_bias_words adds its embedding_bias_weights value to the
    logits of every id its tokenization gives (special tokens included, as TensorRT-LLM's preprocessing does)."""
    words, weights = g.strings("embedding_bias_words"), g.values("embedding_bias_weights")
    weights = [] if weights is None else [float(w) for w in weights]
    if len(words) != len(weights):
        raise ValueError(
            f"embedding_bias_weights: {len(weights)} values for {len(words)} embedding_bias_words"
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError("embedding_bias_weights: values must be finite")
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights):
        for tok in state.engine.tokenizer.encode(word):
            bias[tok] = bias.get(tok, 0.0) + weight
    return bias


# ---- generation ------------------------------------------------------------------------------------------
def rename_fields(message: str, req: TritonRequest) -> str:
    """Engine/processor messages name their own keys; say which Triton input they are about."""
    if req.model == TRTLLM:
        message = re.sub(r"\bprompt_table\b", "prompt_embedding_table", message)
        message = re.sub(r"\bprompt_token_ids\b", "input_ids", message)
        message = re.sub(
            r"^(stop|bad)_token_sequences:", r"\1_words_list:", message
        )  # RequestLimits
        if not message.startswith(tuple(s.name for s in TRTLLM_INPUTS)) and "prompt" in message:
            message = f"input_ids: {message}"
        return message
    message = re.sub(r"^decoder_prompt\b", "decoder_text_input", message)
    message = re.sub(r"^stop:", "stop_words:", message)  # RequestLimits names SamplingParams.stop
    if req.image_field:
        message = re.sub(r"\bpixel_values\b", req.image_field, message)
        message = re.sub(r"^(?:images|videos)(\[\d+\])?", req.image_field + r"\1", message)
    if not message.startswith(tuple(ACCEPTED_INPUTS)) and "prompt" in message:
        message = f"text_input: {message}"
    return message
