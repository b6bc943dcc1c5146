"""The one mapping from Triton tensors to mmserve requests, shared by KServe REST, the generate extension and gRPC
(they differ only in framing): input tensors -> TritonRequest (prompt dict + SamplingParams + options), PROTOCOL
§1, §4. Every bad input raises ValueError naming the tensor. Running them is `triton_run.py`; the output tensors
are built by `triton_outputs.py`."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from mmserve.engine.async_engine import EngineStopped
from mmserve.engine.beam_search import MAX_BEAM_WIDTH, check_length_penalty, unsupported_with_beams
from mmserve.engine.engine import EngineOverloaded
from mmserve.entrypoints.state import ServerBusy, ServerState
from mmserve.entrypoints.triton_models import (
    ACCEPTED_INPUTS,
    ALIASES,
    BLS,
    ENSEMBLE,
    MAX_BATCH_SIZE,
    MODEL_VERSION,
    TRTLLM,
    TRTLLM_INPUTS,
)
from mmserve.entrypoints.triton_prompts import build_prompt
from mmserve.entrypoints.triton_tensors import image_arrays, pixel_values
from mmserve.multimodal.inputs import aload_images
from mmserve.sampling_params import GUIDE_TYPES, SamplingParams

MAX_RETURN_SEQUENCES = 16  # sampled sequences of one prompt (each its own engine request)
IMAGE_INPUTS = ("image_input", "image_bytes_input", "image_url_input", "video_bytes_input")
UNSUPPORTED_INPUTS = ("prompt_embedding_table", "prompt_vocab_size", "num_draft_tokens")
LORA_HOW = (
    "send lora_weights and lora_config with lora_task_id once (TensorRT-LLM's format), or load the adapter "
    "at startup (--lora-modules TASK_ID=PATH); later requests name it with lora_task_id alone"
)


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


@dataclasses.dataclass
class TritonRequest:
    """One batch item of a Triton request, ready for state.generate."""

    model: str
    prompt: dict[str, Any]
    params: SamplingParams
    stream: bool = False
    exclude_input: bool = False
    return_log_probs: bool = False
    image_field: str | None = None  # the input the images came from, for error messages
    beam_width: int = 1  # > 1: beam search (engine/beam_search.py), W completions
    num_return: int = 1  # beams returned, best first (num_return_sequences; beam_width by default)
    length_penalty: float = 1.0
    pad_id: int = 0  # tensorrt_llm: fills output_ids past a shorter sequence
    client_id: str = ""  # the request's Triton `id` (a later `stop` request names it)
    cancel: bool = False  # tensorrt_llm `stop`: abort the running requests of client_id instead


# ---- input tensors -> requests ------------------------------------------------------------------
_KINDS = {"BYTES": "bytes", "BOOL": "bool", "FP16": "float", "FP32": "float", "FP64": "float"}


def _kind(arr: np.ndarray) -> str:
    if arr.dtype == np.object_:
        return "bytes"
    if arr.dtype == np.bool_:
        return "bool"
    return "float" if np.issubdtype(arr.dtype, np.floating) else "int"


def check_tensor(
    model: str,
    name: str,
    arr: np.ndarray,
    batch: int,
    specs: dict | None = None,
    batch_input: str = "text_input",
) -> None:
    """An input's datatype, rank and batch size against its spec (`specs`: the model's, by name)."""
    spec = (ACCEPTED_INPUTS if specs is None else specs).get(name)
    if spec is None:
        raise ValueError(f"unexpected inference input '{name}' for model '{model}'")
    want, got = _KINDS.get(spec.datatype, "int"), _kind(arr)
    if got != want and not (want == "float" and got == "int"):
        raise ValueError(f"{name}: expected datatype {spec.datatype}, got {arr.dtype} ({got} data)")
    ndim_ok = arr.ndim == len(spec.dims) + 1 or (spec.dims == (1,) and arr.ndim == 1)
    fixed_ok = arr.ndim != len(spec.dims) + 1 or all(
        d < 0 or d == n for d, n in zip(spec.dims, arr.shape[1:])
    )
    if not (ndim_ok and fixed_ok):
        raise ValueError(
            f"{name}: expected shape [batch, {', '.join(map(str, spec.dims))}] (-1 = any), "
            f"got {list(arr.shape)}"
        )
    if arr.shape[0] != batch:
        raise ValueError(
            f"{name}: batch size {arr.shape[0]} does not match {batch_input}'s batch size {batch}"
        )


class _Item:
    """Typed access to batch item `b` of the request's tensors."""

    def __init__(self, tensors: dict[str, np.ndarray], b: int) -> None:
        self.tensors, self.b = tensors, b

    def values(self, name: str) -> np.ndarray | None:
        arr = self.tensors.get(name)
        return None if arr is None else arr[self.b].reshape(-1)

    def scalar(self, name: str, default: Any = None) -> Any:
        v = self.values(name)
        if v is None:
            return default
        if v.size != 1:
            raise ValueError(f"{name}: expected a single value per batch item, got {v.size}")
        return v[0].item() if isinstance(v[0], np.generic) else v[0]

    def strings(self, name: str) -> list[str]:
        v = self.values(name)
        try:
            return (
                []
                if v is None
                else [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in v]
            )
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}: not valid UTF-8 ({exc})") from exc


async def parse_request(
    state: ServerState, model: str, tensors: dict[str, np.ndarray], client_id: str = ""
) -> list[TritonRequest]:
    """Input tensors (full shapes, batch first) -> one TritonRequest per batch item. Empty tensors count as
    absent (clients send them for unused optional inputs). `client_id`: the request's Triton `id`."""
    if (
        model == TRTLLM
    ):  # token ids in, token ids out; triton_tokens builds on this module's helpers
        from mmserve.entrypoints.triton_tokens import parse_token_request

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
    if batch > MAX_BATCH_SIZE:
        raise ValueError(
            f"text_input: batch size {batch} exceeds the model's max_batch_size {MAX_BATCH_SIZE}"
        )
    for name, arr in present.items():
        check_tensor(model, name, arr, batch)
    return [await _parse_item(state, model, _Item(present, b)) for b in range(batch)]


def _sampling_params(model: str, g: _Item) -> SamplingParams:
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


def guided_params(g: _Item) -> dict[str, Any]:
    """SamplingParams fields of TensorRT-LLM's guided decoding inputs (the guide is compiled when the engine takes
    the request)."""
    kind = g.strings("guided_decoding_guide_type")
    if not kind:
        return {}
    if kind[0] not in GUIDE_TYPES:
        raise ValueError(
            f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {kind[0]!r}"
        )
    guide = [x for x in g.strings("guided_decoding_guide") if x]
    if kind[0] != "json" and not guide:
        raise ValueError(
            f"guided_decoding_guide: needed for guided_decoding_guide_type {kind[0]!r}"
        )
    return {"guided_decoding_type": kind[0], "guided_decoding_guide": guide[0] if guide else None}


async def lora_name(state: ServerState, g: _Item) -> str | None:
    """The adapter lora_task_id names (loading one sent with the request first), or None."""
    task = g.scalar("lora_task_id")
    await _load_lora(state, g, task)
    if task is None:
        return None
    if str(int(task)) not in state.lora_names:
        raise ValueError(
            f"lora_task_id: LoRA task {int(task)} is not loaded (loaded: "
            f"{', '.join(state.lora_names) or 'none'}); {LORA_HOW}"
        )
    return str(int(task))


async def _parse_item(state: ServerState, model: str, g: _Item) -> TritonRequest:
    text = g.strings("text_input")
    if len(text) != 1:
        raise ValueError(f"text_input: expected a single string per batch item, got {len(text)}")
    params = _sampling_params(model, g)
    bias = _embedding_bias(state, g)
    if bias:
        params = dataclasses.replace(params, logit_bias=bias)
    given = [name for name in IMAGE_INPUTS if name in g.tensors]
    if len(given) > 1:
        raise ValueError(
            f"only one of {', '.join(IMAGE_INPUTS)} may be given, got {', '.join(given)}"
        )
    prompt: dict[str, Any] = {}
    num_images = num_videos = 0
    field = given[0] if given else None
    if field == "image_input":
        prompt["pixel_values"] = pixel_values(g.tensors[field][g.b])
        num_images = len(prompt["pixel_values"])
        if num_images > state.media.max_images_per_request:
            raise ValueError(
                f"image_input: {num_images} images, max_images_per_request="
                f"{state.media.max_images_per_request}"
            )
    elif field == "image_bytes_input":
        sizes = g.tensors["image_sizes_input"][g.b] if "image_sizes_input" in g.tensors else None
        arrays = image_arrays(field, g.tensors[field][g.b], sizes)
        prompt["images"] = await aload_images(arrays, state.media, field=field)
        num_images = len(arrays)
    elif field == "image_url_input":
        urls = g.strings(field)
        if any(not u.strip() for u in urls):
            raise ValueError("image_url_input: empty URL")
        prompt["images"] = await aload_images([u.strip() for u in urls], state.media, field=field)
        num_images = len(urls)
    elif field == "video_bytes_input":  # decoded frames [F, H, W, 3] (or [F, 3, H, W])
        frames = g.tensors[field][g.b]
        if frames.ndim == 4 and frames.shape[-1] != 3 and frames.shape[1] == 3:
            frames = frames.transpose(0, 2, 3, 1)
        prompt["videos"], num_videos = [np.ascontiguousarray(frames)], 1
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
    inputs = getattr(state.engine.engine, "inputs", None)
    prompt["prompt"] = build_prompt(
        state.model_type,
        text[0],
        num_images,
        num_videos=num_videos,
        wrap=model in (ENSEMBLE, BLS),
        image_token=getattr(inputs, "image_token", None),
        video_token=getattr(inputs, "video_token", None),
    )
    stream = bool(g.scalar("stream", False))
    width = beam_width(g, params)
    num_return = num_return_sequences(g, width)
    return TritonRequest(
        model,
        prompt,
        params,
        stream=stream,
        exclude_input=bool(g.scalar("exclude_input_in_output", False)),
        return_log_probs=params.logprobs is not None,
        image_field=field,
        beam_width=width,
        length_penalty=check_length_penalty(float(g.scalar("length_penalty", 1.0))),
        num_return=num_return,
    )


def num_return_sequences(g: _Item, width: int) -> int:
    """With beams, the N best of the W (default W); without, N sequences sampled for the prompt (default 1)."""
    num_return = int(g.scalar("num_return_sequences", width))
    if width > 1 and not 1 <= num_return <= width:
        raise ValueError(
            f"num_return_sequences must be in [1, beam_width = {width}], got {num_return}"
        )
    if width == 1 and not 1 <= num_return <= MAX_RETURN_SEQUENCES:
        raise ValueError(
            f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], got {num_return}"
        )
    return num_return


def beam_width(g: _Item, params: SamplingParams) -> int:
    """The request's beam_width, checked against what beam search here supports."""
    width = int(g.scalar("beam_width", 1))
    if width == 1:
        return 1
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {width}")
    field = unsupported_with_beams(params)
    if field is not None:
        raise ValueError(f"{field}: not supported with beam_width > 1 yet")
    return width


def _embedding_bias(state: ServerState, g: _Item) -> dict[int, float]:
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


async def _load_lora(state: ServerState, g: _Item, task: Any) -> None:
    """An adapter sent with the request (lora_weights + lora_config, TensorRT-LLM's format) is cached as its
    lora_task_id, on the engine thread."""
    weights, config = g.tensors.get("lora_weights"), g.tensors.get("lora_config")
    if weights is None and config is None:
        return
    if weights is None or config is None:
        missing = "lora_weights" if weights is None else "lora_config"
        raise ValueError(f"{missing}: missing; lora_weights and lora_config are sent together")
    if task is None:
        raise ValueError("lora_weights: needs lora_task_id, the id the adapter is cached under")
    w, c = weights[g.b], config[g.b].reshape(-1, 3) if config[g.b].size % 3 == 0 else config[g.b]
    if w.ndim == 2 and w.shape[0] == 1 and len(c) > 1 and w.size % len(c) == 0:
        w = w.reshape(len(c), -1)  # the generate extension sends a JSON array as one row
    await state.engine.add_lora_tensors(str(int(task)), w, c)


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
