"""The token-level `tensorrt_llm` Triton model (PROTOCOL §1.5): what TensorRT-LLM's ensembles call after their
tokenizer, and what its own clients (`inflight_batcher_llm_client.py`) call directly: input_ids / input_lengths /
request_output_len and TensorRT-LLM's runtime names (runtime_top_k, len_penalty, streaming, stop_words_list as
[2, L] token lists, embedding_bias over the vocabulary) -> TritonRequests of prompt token ids. `stop` true cancels
the running requests sent under the same request id. Outputs are built by outputs.py (output_ids,
sequence_length). Pictures come as TensorRT-LLM passes them to this
model: visual features in `prompt_embedding_table` [F, hidden], which prompt ids from the vocabulary size on
stand for (multimodal/prompt_table.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton.models import ALIASES, TRTLLM, TRTLLM_INPUTS
from mmserve.entrypoints.triton.requests import (
    BatchItem,
    TritonRequest,
    beam_width,
    check_tensor,
    guided_params,
    lora_name,
    num_return_sequences,
)
from mmserve.sampling_params import SamplingParams

SPECS = {s.name: s for s in TRTLLM_INPUTS}
REQUIRED = [s.name for s in TRTLLM_INPUTS if not s.optional]


async def parse_token_request(
    state: ServerState, tensors: dict[str, np.ndarray]
) -> list[TritonRequest]:
    """Input tensors (batch first; empty ones count as absent) -> one TritonRequest per batch item. `stop` true
    makes it a cancel of the running requests sent under the same request id (the other inputs are ignored, as
    TensorRT-LLM's client sends placeholders with it)."""
    tensors = {ALIASES.get(k, k): v for k, v in tensors.items() if v.size}
    if "stop" in tensors and tensors["stop"].dtype == np.bool_ and tensors["stop"].any():
        return [TritonRequest(TRTLLM, {}, SamplingParams(), cancel=True)]
    for name in REQUIRED:
        if name not in tensors:
            raise ValueError(f"{name} is required")
    batch = tensors["input_ids"].shape[0] if tensors["input_ids"].ndim else 0
    limit = state.config.max_batch_size  # what the model config reports (--max-num-seqs)
    if not 1 <= batch <= limit:
        raise ValueError(f"input_ids: batch size must be in [1, {limit}], got {batch}")
    for name, arr in tensors.items():
        check_tensor(TRTLLM, name, arr, batch, SPECS, batch_input="input_ids")
    return [await _parse_item(state, BatchItem(tensors, b)) for b in range(batch)]


def word_lists(g: BatchItem, name: str) -> list[list[int]]:
    """TensorRT-LLM's [2, L] word list of one batch item: row 0 the words' token ids end to end, row 1 each
    word's end offset into row 0, padded with -1 (e.g. words [5, 6] and [7]: [[5, 6, 7], [2, 3, -1]])."""
    arr = g.tensors.get(name)
    if arr is None:
        return []
    item = arr[g.b]
    if item.ndim != 2 or item.shape[0] != 2:
        raise ValueError(
            f"{name}: expected [2, L] per batch item (token ids, end offsets), got {list(item.shape)}"
        )
    ids, ends = item[0].tolist(), [int(e) for e in item[1] if e >= 0]
    words, start = [], 0
    for end in ends:
        if not start < end <= len(ids):
            raise ValueError(
                f"{name}: end offsets must increase within the {len(ids)} token ids, got {ends}"
            )
        word = [int(t) for t in ids[start:end]]
        if any(t < 0 for t in word):
            raise ValueError(f"{name}: negative token id in {word}")
        words.append(word)
        start = end
    return words


def _prompt_ids(g: BatchItem, vocab: int, table_rows: int) -> list[int]:
    ids = g.values("input_ids")
    length = g.scalar("input_lengths")
    if length is None or not 1 <= int(length) <= len(ids):
        raise ValueError(
            f"input_lengths must be in [1, {len(ids)}] (the input_ids given), got {length}"
        )
    prompt = [int(t) for t in ids[: int(length)]]
    if any(not 0 <= t < vocab + table_rows for t in prompt):
        rows = (
            f", or [{vocab}, {vocab + table_rows}) for prompt_embedding_table rows"
            if table_rows
            else ""
        )
        raise ValueError(f"input_ids: token ids must be in [0, {vocab}) (the vocabulary){rows}")
    return prompt


def _prompt_table(g: BatchItem) -> np.ndarray | None:
    """This item's prompt_embedding_table [F, hidden], checked against prompt_vocab_size (F) when that is given."""
    table = g.tensors.get("prompt_embedding_table")
    if table is None:
        if g.scalar("prompt_vocab_size") is not None:
            raise ValueError("prompt_vocab_size: given without prompt_embedding_table")
        return None
    table = table[g.b]
    if table.ndim != 2:
        raise ValueError(
            f"prompt_embedding_table: expected [batch, rows, hidden], got {table.ndim + 1}-D"
        )
    size = g.scalar("prompt_vocab_size")
    if size is not None and int(size) != len(table):
        raise ValueError(
            f"prompt_vocab_size: {size}, but prompt_embedding_table has {len(table)} rows"
        )
    return table


def _embedding_bias(g: BatchItem, vocab: int) -> dict[int, float]:
    bias = g.values("embedding_bias")
    if bias is None:
        return {}
    if len(bias) != vocab:
        raise ValueError(
            f"embedding_bias: expected one value per vocabulary id ({vocab}), got {len(bias)}"
        )
    if not np.isfinite(bias).all():
        raise ValueError("embedding_bias: values must be finite")
    return {int(i): float(bias[i]) for i in np.flatnonzero(bias)}


def _sampling_params(g: BatchItem, vocab: int) -> SamplingParams:
    max_tokens = g.scalar("request_output_len")
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(f"request_output_len must be a single value > 0, got {max_tokens}")
    kw: dict[str, Any] = {"max_tokens": int(max_tokens)}
    for name, key in (
        ("temperature", "temperature"),
        ("repetition_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ):
        if (v := g.scalar(name)) is not None:
            kw[key] = float(v)
    for name, key in (("runtime_top_k", "top_k"), ("min_tokens", "min_tokens"), ("seed", "seed")):
        if (v := g.scalar(name)) is not None:
            kw[key] = int(v)
    if (top_p := g.scalar("runtime_top_p")) is not None:
        kw["top_p"] = 1.0 if top_p == 0 else float(top_p)  # TensorRT-LLM: top_p 0 means off
    end_id = g.scalar("end_id")
    if end_id is not None and end_id >= 0:
        kw["eos_token_id"] = int(end_id)
    kw["stop_token_sequences"] = word_lists(g, "stop_words_list")
    kw["bad_token_sequences"] = word_lists(g, "bad_words_list")
    kw["logit_bias"] = _embedding_bias(g, vocab)
    kw.update(guided_params(g))
    for name in ("return_context_logits", "return_generation_logits"):
        kw[name] = bool(g.scalar(name, False))
    if g.scalar("return_log_probs", False):
        kw["logprobs"] = 0
    try:
        return SamplingParams(**kw)
    except ValueError as exc:  # name TensorRT-LLM's inputs, not SamplingParams' fields
        message = str(exc)
        for field, name in (
            ("top_k", "runtime_top_k"),
            ("top_p", "runtime_top_p"),
            ("max_tokens", "request_output_len"),
            ("eos_token_id", "end_id"),
            ("stop_token_sequences", "stop_words_list"),
            ("bad_token_sequences", "bad_words_list"),
            ("logit_bias", "embedding_bias"),
        ):
            if message.startswith(field + " "):
                message = name + message[len(field) :]
        raise ValueError(message) from exc


async def _parse_item(state: ServerState, g: BatchItem) -> TritonRequest:
    vocab = state.engine.model_info.vocab_size
    params = _sampling_params(g, vocab)
    table = _prompt_table(g)
    prompt: dict[str, Any] = {
        "prompt_token_ids": _prompt_ids(g, vocab, 0 if table is None else len(table))
    }
    if table is not None:
        prompt["prompt_table"] = torch.from_numpy(np.ascontiguousarray(table, dtype=np.float32))
        extra = g.values("prompt_table_extra_ids")
        # as TensorRT-LLM's python backend: cut to the prompt when it covers it, else ignored
        if extra is not None and len(extra) >= len(prompt["prompt_token_ids"]):
            prompt["prompt_table_extra_ids"] = [
                int(e) for e in extra[: len(prompt["prompt_token_ids"])]
            ]
    if (lora := await lora_name(state, g)) is not None:
        prompt["lora"] = lora
    stream = bool(g.scalar("streaming", False))
    width = beam_width(g, params)
    length_penalty = float(g.scalar("len_penalty", 1.0))
    if not math.isfinite(length_penalty):
        raise ValueError(f"len_penalty must be finite, got {length_penalty}")
    end_id = (
        params.eos_token_id
        if params.eos_token_id is not None
        else state.engine.tokenizer.eos_token_id
    )
    pad_id = g.scalar("pad_id", end_id if end_id is not None else 0)
    return TritonRequest(
        TRTLLM,
        prompt,
        params,
        stream=stream,
        exclude_input=g.flag("exclude_input_in_output"),
        return_log_probs=params.logprobs is not None,
        beam_width=width,
        num_return=num_return_sequences(g, width),
        length_penalty=length_penalty,
        pad_id=int(pad_id),
    )
