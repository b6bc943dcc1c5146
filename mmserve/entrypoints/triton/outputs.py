"""Output tensors of the Triton models from mmserve's RequestOutputs: the text (with or without the prompt), or
the `tensorrt_llm` model's token ids and sequence lengths; log probs, context / generation logits, the BLS
model's timing and KV-cache metrics, and the client's choice of outputs (PROTOCOL §1)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.core.outputs import RequestOutput
from mmserve.core.transfer import cdiv
from mmserve.entrypoints.triton.models import (
    BLS,
    BLS_EXTRA_OUTPUTS,
    OUTPUTS,
    TRTLLM,
    TRTLLM_OUTPUTS,
    outputs_of,
)

BLS_METRICS = frozenset(s.name for s in BLS_EXTRA_OUTPUTS)


@dataclass
class Chunk:
    """What one response carries for one batch item."""

    text: str
    out: RequestOutput
    first_token: int = 0  # output_log_probs covers out's token_ids[first_token:]
    logprobs: bool = False
    beams: list[str] | None = (
        None  # beam search: each completion's text, best first (`text` is the first)
    )
    with_prompt: bool = False  # tensorrt_llm: output_ids start with the prompt's ids
    pad_id: int = 0  # tensorrt_llm: fills output_ids past a shorter beam or batch item
    sequence_index: int = 0  # a streamed response of one of num_return_sequences sampled sequences


def full_text(tokenizer: Any, out: RequestOutput, exclude_input: bool, index: int = 0) -> str:
    """text_output of a non-streaming response: the decoded prompt, then completion `index` (PROTOCOL §6)."""
    completion = out.outputs[index]
    if exclude_input:
        return completion.text
    prompt_ids, ids = list(out.prompt_token_ids), list(completion.token_ids)
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    # the space a tokenizer puts between prompt and completion only shows when they are decoded together
    joint = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
    alone = tokenizer.decode(ids, skip_special_tokens=True)
    sep = ""
    if joint.startswith(prompt) and joint.endswith(alone):
        sep = joint[len(prompt) : len(joint) - len(alone)]
    return prompt + (sep if sep.isspace() else "") + completion.text


def _bls_metrics(chunks: list[Chunk], block_size: int) -> dict[str, np.ndarray]:
    def col(values, dtype):
        return np.array(values, dtype=dtype).reshape(len(chunks), 1)

    def ns(t):
        return int(t * 1e9) if t else 0

    ms = [c.out.metrics for c in chunks]
    total = [
        cdiv(len(c.out.prompt_token_ids) + len(c.out.outputs[0].token_ids), block_size)
        for c in chunks
    ]
    reused = [(m.num_cached_tokens if m else 0) // block_size for m in ms]
    zeros = [0] * len(chunks)
    return {
        "kv_cache_alloc_new_blocks": col([t - r for t, r in zip(total, reused)], np.int32),
        "kv_cache_reused_blocks": col(reused, np.int32),
        "kv_cache_alloc_total_blocks": col(total, np.int32),
        "arrival_time_ns": col([ns(m and m.arrival_time) for m in ms], np.int64),
        "first_scheduled_time_ns": col([ns(m and m.first_scheduled_time) for m in ms], np.int64),
        "first_token_time_ns": col([ns(m and m.first_token_time) for m in ms], np.int64),
        "last_token_time_ns": col(
            [ns(m and (m.finished_time or m.first_token_time)) for m in ms], np.int64
        ),
        "acceptance_rate": col(zeros, np.float32),
        "total_accepted_draft_tokens": col(zeros, np.int32),
        "total_draft_tokens": col(zeros, np.int32),
    }


class Outputs(Mapping[str, np.ndarray]):
    """The output tensors of one response, built on first read: a stream's SSE encoder writes most events
    straight from `chunks` (stream_events.py) and never needs them, and the BLS model's metrics are built only
    once one of them is read. Iteration builds them all, in make_outputs' order."""

    def __init__(self, chunks: list[Chunk], model: str, block_size: int) -> None:
        self.chunks, self.model, self.block_size = chunks, model, block_size
        self._tensors: dict[str, np.ndarray] | None = None
        self._with_metrics = model != BLS

    def _built(self, metrics: bool) -> dict[str, np.ndarray]:
        if self._tensors is None:
            self._tensors = _tensors(self.chunks, self.model)
        if metrics and not self._with_metrics:
            self._tensors.update(_bls_metrics(self.chunks, self.block_size))
            self._with_metrics = True
        return self._tensors

    def __getitem__(self, name: str) -> np.ndarray:
        return self._built(name in BLS_METRICS)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._built(True))

    def __len__(self) -> int:
        return len(self._built(True))


def make_outputs(chunks: list[Chunk], model: str, block_size: int = 16) -> Outputs:
    """Output tensors of one response. Shapes follow the seeds: text_output [batch * beams] (one string per item
    and beam), cum_log_probs [batch, beams], output_log_probs [batch, beams, tokens]; context_logits [batch,
    prompt, vocab] and generation_logits [batch, 1, tokens, vocab] (fp32, zero-padded across the batch) on the
    response that finishes a request that asked for them, else zero placeholders [batch, 1, 1] / [batch, 1, 1, 1].
    The tensorrt_llm model answers output_ids [batch, beams, tokens] and sequence_length [batch, beams] instead of
    text_output; the BLS model adds its metrics (BLS_EXTRA_OUTPUTS)."""
    return Outputs(chunks, model, block_size)


def _tensors(chunks: list[Chunk], model: str) -> dict[str, np.ndarray]:
    n = len(chunks)
    beams = max(len(c.beams or [c.text]) for c in chunks)
    per_token: list[list[list[float]]] = []
    cum = np.zeros((n, beams), dtype=np.float32)
    for i, c in enumerate(chunks):
        rows = []
        for k, comp in enumerate(c.out.outputs[: len(c.beams or [c.text])]):
            cum[i, k], row = log_prob_row(c, comp)
            rows.append(row)
        per_token.append(rows)
    width = max(len(r) for rows in per_token for r in rows)
    out_lp = np.zeros((n, beams, width), dtype=np.float32)
    for i, rows in enumerate(per_token):
        for k, r in enumerate(rows):
            out_lp[i, k, : len(r)] = r
    return {
        **(_token_ids(chunks, beams) if model == TRTLLM else {"text_output": _texts(chunks)}),
        "cum_log_probs": cum,
        "output_log_probs": out_lp,
        "context_logits": _stack_logits([c.out.context_logits for c in chunks], (1, 1)),
        "generation_logits": _stack_logits([c.out.generation_logits for c in chunks], (1, 1))[
            :, None
        ],
        "batch_index": np.arange(n, dtype=np.int32).reshape(n, 1),
        "sequence_index": np.array([c.sequence_index for c in chunks], dtype=np.int32).reshape(
            n, 1
        ),
    }


def log_prob_row(c: Chunk, comp) -> tuple[float, list[float]]:
    """(cum_log_probs, output_log_probs) of one completion `comp` of a chunk: its new tokens' log-probs, zeros when
    the request asked for none."""
    ids = comp.token_ids[c.first_token :]
    lps = (comp.logprobs or [])[c.first_token :] if c.logprobs else []
    row = [entry[t].logprob for entry, t in zip(lps, ids)] if lps else [0.0] * len(ids)
    return ((comp.cumulative_logprob or 0.0) if c.logprobs else 0.0), row


def output_id_row(c: Chunk, comp) -> list[int]:
    """output_ids of one completion `comp` of a chunk: the prompt's ids first when with_prompt, then its new ids."""
    return (list(c.out.prompt_token_ids) if c.with_prompt else []) + list(
        comp.token_ids[c.first_token :]
    )


def _texts(chunks: list[Chunk]) -> np.ndarray:
    texts = [t for c in chunks for t in (c.beams or [c.text])]
    text = np.empty(len(texts), dtype=np.object_)
    text[:] = [t.encode("utf-8") for t in texts]
    return text


def _token_ids(chunks: list[Chunk], beams: int) -> dict[str, np.ndarray]:
    """output_ids [batch, beams, tokens] (the prompt's ids first when with_prompt; a stream's piece: its new ids)
    and sequence_length [batch, beams], as the tensorrt_llm model returns them."""
    rows = [
        [output_id_row(c, comp) for comp in c.out.outputs[: len(c.beams or [c.text])]]
        for c in chunks
    ]
    width = max(len(r) for item in rows for r in item)
    ids = np.empty((len(chunks), beams, width), dtype=np.int32)
    lengths = np.zeros((len(chunks), beams), dtype=np.int32)
    for i, (c, item) in enumerate(zip(chunks, rows)):
        ids[i] = c.pad_id
        for k, r in enumerate(item):
            ids[i, k, : len(r)] = r
            lengths[i, k] = len(r)
    return {"output_ids": ids, "sequence_length": lengths}


def _stack_logits(items: list, empty: tuple[int, int]) -> np.ndarray:
    """[n, rows, vocab] fp32 from per-item [rows, vocab] tensors (None: no logits), zero-padded."""
    arrays = [None if t is None else t.numpy() for t in items]
    rows = max([a.shape[0] for a in arrays if a is not None] or [empty[0]])
    vocab = max([a.shape[1] for a in arrays if a is not None] or [empty[1]])
    out = np.zeros((len(items), rows, vocab), dtype=np.float32)
    for i, a in enumerate(arrays):
        if a is not None:
            out[i, : a.shape[0], : a.shape[1]] = a
    return out


def select_outputs(
    tensors: Mapping[str, np.ndarray], requested: list[str] | None, model: str
) -> dict[str, np.ndarray]:
    """The outputs a request asked for, in its order; all of the model's standard ones when it named none."""
    if not requested:
        return {s.name: tensors[s.name] for s in (TRTLLM_OUTPUTS if model == TRTLLM else OUTPUTS)}
    known = {s.name for s in outputs_of(model)}
    for name in requested:
        if name not in known:
            raise ValueError(f"unexpected inference output '{name}' for model '{model}'")
    return {name: tensors[name] for name in dict.fromkeys(requested)}
