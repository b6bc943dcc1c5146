"""The generate extension's JSON documents (PROTOCOL §2.1), whole or as a stream's events.

`generate_json` writes one response as the extension does: outputs flattened (a bare scalar when one element),
parameters as keys, all keys sorted. `StreamEncoder` writes the same bytes for the responses of one
`generate_stream`: the document's keys and every value that cannot change within a stream (model, id, sequence
parameters, the zero logits placeholders, batch_index) are rendered once, as text around a few slots, and each
event renders only the slots' values (text or token ids, log probs, sequence_index) from the response's chunk,
never building its tensors. A response the template does not cover (logits, beams, a batch, tensors that are not
make_outputs' Outputs) or that fails to render goes the whole way through `generate_json`.
"""

from __future__ import annotations

from collections.abc import Mapping
from json.encoder import encode_basestring
from typing import Any

import numpy as np

from mmserve.entrypoints.json_wire import dumps, dumps_text, float_text
from mmserve.entrypoints.triton.models import (
    MODEL_VERSION,
    OUTPUTS,
    TRTLLM,
    TRTLLM_OUTPUTS,
    has_sequence_parameters,
)
from mmserve.entrypoints.triton.outputs import (
    Chunk,
    Outputs,
    log_prob_row,
    output_id_row,
    select_outputs,
)
from mmserve.entrypoints.triton.tensors import to_json

SEQUENCE_PARAMETERS = {"sequence_id": 0, "sequence_start": False, "sequence_end": False}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# make_outputs' values for one batch item whose request asked for no logits, flattened
_CONSTANT_OUTPUTS: dict[str, Any] = {
    "batch_index": 0,
    "context_logits": 0.0,
    "generation_logits": 0.0,
}
_TEXT_SLOTS = frozenset({"text_output", "cum_log_probs", "output_log_probs", "sequence_index"})
_TOKEN_SLOTS = frozenset(
    {"output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "sequence_index"}
)


def _header(model: str, request_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    if request_id:
        doc["id"] = request_id
    if has_sequence_parameters(model):
        doc.update(SEQUENCE_PARAMETERS)
    return doc


def generate_json(model: str, request_id: str, tensors: Mapping[str, np.ndarray]) -> bytes:
    """One response as the generate extension writes it: these outputs flattened (a bare scalar when one
    element), parameters as keys, all keys sorted."""
    doc = _header(model, request_id)
    for name, arr in tensors.items():
        values = to_json(arr)
        doc[name] = values[0] if len(values) == 1 else values
    return dumps(doc, sort_keys=True)


def _template(fixed: dict[str, Any], slots: frozenset[str]) -> tuple[list[str], list[str]]:
    """The document's text around its slots, keys in dumps(sort_keys=True)'s order: pieces[0], the value of
    names[0], pieces[1], ..., pieces[-1]."""
    pieces, names, text = [], [], "{"
    for i, key in enumerate(sorted([*fixed, *slots])):
        text += ("," if i else "") + encode_basestring(key) + ":"
        if key in slots:
            pieces.append(text)
            names.append(key)
            text = ""
        else:
            text += dumps_text(fixed[key])
    pieces.append(text + "}")
    return pieces, names


def _flat(items: list[str]) -> str:
    """A [1, 1, n] tensor's values as generate_json writes them: a bare scalar when n is 1."""
    return items[0] if len(items) == 1 else "[" + ",".join(items) + "]"


def _int32(value: int) -> str:
    if not INT32_MIN <= value <= INT32_MAX:
        raise OverflowError(f"{value} does not fit int32")
    return int.__repr__(value)


def _int32s(values: list[int]) -> list[str]:
    if values and (min(values) < INT32_MIN or max(values) > INT32_MAX):
        raise OverflowError("a value does not fit int32")
    return [int.__repr__(v) for v in values]


def _log_probs(c: Chunk) -> tuple[str, str]:
    """cum_log_probs and output_log_probs of a one-beam chunk, as make_outputs computes them (fp32)."""
    comp = c.out.outputs[0]
    if not c.logprobs:  # zeros, without the fp32 round trip
        return "0.0", _flat(["0.0"] * (len(comp.token_ids) - c.first_token))
    cum, row = log_prob_row(c, comp)
    cum, *values = np.array([cum, *row], dtype=np.float32).tolist()
    return float_text(cum), _flat([float_text(v) for v in values])


def _slot_values(c: Chunk, model: str) -> dict[str, str]:
    cum, per_token = _log_probs(c)
    values = {
        "cum_log_probs": cum,
        "output_log_probs": per_token,
        "sequence_index": _int32(c.sequence_index),
    }
    if model == TRTLLM:
        # make_outputs fills output_ids with the pad id first, raising where it does not fit
        _int32(c.pad_id)
        row = output_id_row(c, c.out.outputs[0])
        values["output_ids"] = _flat(_int32s(row))
        values["sequence_length"] = int.__repr__(len(row))
    else:
        values["text_output"] = encode_basestring(c.text)
    return values


def _one_plain_chunk(tensors: Mapping[str, np.ndarray], model: str) -> Chunk | None:
    """The response's chunk when the template covers it: one batch item, one sequence, no logits."""
    if type(tensors) is not Outputs or tensors.model != model or len(tensors.chunks) != 1:
        return None
    c = tensors.chunks[0]
    out = c.out
    if c.beams or not out.outputs or out.context_logits is not None:
        return None
    return c if out.generation_logits is None else None


class StreamEncoder:
    """The events of one generate_stream: `encode(tensors)` is generate_json(model, request_id,
    select_outputs(tensors, None, model)), byte for byte."""

    def __init__(self, model: str, request_id: str) -> None:
        self.model, self.request_id = model, request_id
        names = [s.name for s in (TRTLLM_OUTPUTS if model == TRTLLM else OUTPUTS)]
        slots = _TOKEN_SLOTS if model == TRTLLM else _TEXT_SLOTS
        fixed = _header(model, request_id)
        self._pieces: list[str] | None = None
        if set(names) == slots | _CONSTANT_OUTPUTS.keys():
            fixed.update(_CONSTANT_OUTPUTS)
            self._pieces, self._names = _template(fixed, slots)

    def encode(self, tensors: Mapping[str, np.ndarray]) -> bytes:
        """The response's document; its slots' values rendered when the template covers it."""
        chunk = None if self._pieces is None else _one_plain_chunk(tensors, self.model)
        if chunk is not None:
            try:
                return self._fill(_slot_values(chunk, self.model))
            except Exception:  # what the template cannot write, generate_json writes (or raises on)
                pass
        return generate_json(self.model, self.request_id, select_outputs(tensors, None, self.model))

    def _fill(self, values: dict[str, str]) -> bytes:
        pieces = self._pieces
        parts = [pieces[0]]
        for name, piece in zip(self._names, pieces[1:]):
            parts.append(values[name])
            parts.append(piece)
        return "".join(parts).encode("utf-8")
