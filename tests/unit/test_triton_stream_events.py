"""StreamEncoder writes each generate_stream event byte for byte as the whole path does: the response's tensors
built, the standard outputs chosen, flattened into the document and `dumps(doc, sort_keys=True)`."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from mmserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from mmserve.entrypoints.json_wire import dumps
from mmserve.entrypoints.triton import http as triton_http
from mmserve.entrypoints.triton import run as triton_run
from mmserve.entrypoints.triton import stream_events
from mmserve.entrypoints.triton.models import BLS, ENSEMBLE, MODEL_VERSION, TRTLLM
from mmserve.entrypoints.triton.outputs import Chunk, Outputs, make_outputs, select_outputs
from mmserve.entrypoints.triton.stream_events import StreamEncoder
from mmserve.entrypoints.triton.tensors import to_json

TEXT_MODELS = (ENSEMBLE, BLS)
REQUEST_IDS = ("", "req-42", 'a "quoted" \\ id\n', "ид-😀")
TEXTS = (
    " Hello",
    "",
    'say "hi"',
    "back\\slash",
    "\n\t\r\b\f",
    "\x00\x01\x1f\x7f\x80\x9f",
    "emoji 😀 é 中文",
    "\u2028\u2029 </script>",
    "\ufeff\uffff",
)


def reference(model: str, request_id: str, tensors: Any) -> bytes:
    """The event as generate_stream wrote it before the encoder: every output tensor built and written."""
    doc: dict[str, Any] = {"model_name": model, "model_version": MODEL_VERSION}
    if request_id:
        doc["id"] = request_id
    if model == ENSEMBLE:
        doc.update({"sequence_id": 0, "sequence_start": False, "sequence_end": False})
    for name, arr in select_outputs(dict(tensors.items()), None, model).items():
        values = to_json(arr)
        doc[name] = values[0] if len(values) == 1 else values
    return b"data: " + dumps(doc, sort_keys=True) + b"\n\n"


def event(encoder: StreamEncoder, tensors: Any) -> bytes:
    return triton_http._sse(
        triton_http._generate_json(encoder.model, encoder.request_id, tensors, encoder)
    )


def _chunk(
    text: str = " Hello",
    ids: tuple[int, ...] = (11, 12, 13),
    first_token: int = 0,
    logprobs: list[float] | None = None,
    cum: float | None = None,
    finish: str | None = None,
    **fields: Any,
) -> Chunk:
    entries = None if logprobs is None else [{t: Logprob(v)} for t, v in zip(ids, logprobs)]
    comp = CompletionOutput(0, "whole " + text, list(ids), cum, entries, finish)
    out = RequestOutput("r", "p", [1, 2, 3], [comp], finish is not None)
    return Chunk(text, out, first_token, logprobs is not None, **fields)


def assert_same(model: str, request_id: str, chunk: Chunk, template: bool = True) -> None:
    """The encoder's event equals the reference; `template`: written without building the tensors."""
    encoder = StreamEncoder(model, request_id)
    tensors = make_outputs([chunk], model, 16)
    got = event(encoder, tensors)
    assert (tensors._tensors is None) == template
    assert got == reference(model, request_id, make_outputs([chunk], model, 16))


# ---- text models: deltas, escaping, ids ------------------------------------------------------------------


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("request_id", REQUEST_IDS)
@pytest.mark.parametrize("text", TEXTS)
def test_text_deltas_and_escaping(model, request_id, text):
    assert_same(model, request_id, _chunk(text))


TEXT_CASES = {
    "one new token": dict(ids=(5, 6, 7), first_token=2),
    "no new token": dict(text="", ids=(5, 6), first_token=2),
    "no token at all": dict(text="", ids=()),
    "final with finish reason": dict(text="end.", first_token=1, finish="stop"),
    "final, empty delta": dict(text="", ids=(5, 6), first_token=2, finish="length"),
    "accumulated text": dict(text="all of the text so far", first_token=2),
    "log probs": dict(logprobs=[-0.1, -2.5, -0.0], cum=-2.6),
    "log probs of the new tokens": dict(logprobs=[-0.1, -2.5, -0.3], cum=-2.9, first_token=1),
    "one new token's log prob": dict(logprobs=[-0.1, -2.5, -0.3], cum=-2.9, first_token=2),
    "log probs, no new token": dict(text="", logprobs=[-0.1], cum=-0.1, ids=(5,), first_token=1),
    "log probs missing": dict(logprobs=[], cum=None),
    "fewer log probs than tokens": dict(logprobs=[-0.5], cum=-0.5),
    "non-finite log probs": dict(logprobs=[-math.inf, math.nan, math.inf], cum=-math.inf),
    "nan cumulative": dict(logprobs=[-1.0, -1.0, -1.0], cum=math.nan),
    "float32 rounding": dict(logprobs=[0.1, 1e-50, -3.4028234e38], cum=1 / 3),
    "zero cumulative, negative zero": dict(logprobs=[-0.0, 0.0, -1e-45], cum=-0.0),
    "sampled sequence index": dict(sequence_index=3),
}


@pytest.mark.parametrize("model", TEXT_MODELS)
@pytest.mark.parametrize("request_id", ("", "req-42"))
@pytest.mark.parametrize("case", TEXT_CASES.values(), ids=TEXT_CASES.keys())
def test_text_cases(model, request_id, case):
    assert_same(model, request_id, _chunk(**case))


# ---- tensorrt_llm: token ids ------------------------------------------------------------------------------

TOKEN_CASES = {
    "new ids": dict(ids=(5, 6, 7), first_token=1),
    "one new id": dict(ids=(5, 6, 7), first_token=2),
    "no new id, final": dict(ids=(5, 6), first_token=2, finish="stop"),
    "largest ids": dict(ids=(2**31 - 1, 0, -(2**31))),
    "with the prompt": dict(ids=(8, 9), with_prompt=True),
    "pad id": dict(ids=(8, 9), first_token=1, pad_id=7),
    "log probs": dict(ids=(8, 9), logprobs=[-0.25, -4.0], cum=-4.25),
    "sampled sequence index": dict(ids=(8, 9), sequence_index=2),
}


@pytest.mark.parametrize("request_id", REQUEST_IDS)
@pytest.mark.parametrize("case", TOKEN_CASES.values(), ids=TOKEN_CASES.keys())
def test_token_id_cases(request_id, case):
    assert_same(TRTLLM, request_id, _chunk(text="", **case))


# ---- responses the template leaves to the whole path ------------------------------------------------------


def _with_logits(chunk: Chunk, which: str) -> Chunk:
    setattr(chunk.out, which, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    return chunk


def _beams() -> Chunk:
    chunk = _chunk("a")
    chunk.out.outputs.append(CompletionOutput(1, "b", [21], None, None, None))
    chunk.beams = ["a", "b"]
    return chunk


FALLBACK_CASES = {
    "context logits": lambda: _with_logits(_chunk(), "context_logits"),
    "generation logits": lambda: _with_logits(_chunk(), "generation_logits"),
    "beams": _beams,
}


@pytest.mark.parametrize("model", (*TEXT_MODELS, TRTLLM))
@pytest.mark.parametrize("case", FALLBACK_CASES.values(), ids=FALLBACK_CASES.keys())
def test_responses_outside_the_template_take_the_whole_path(model, case):
    assert_same(model, "req-1", case(), template=False)


def test_a_batch_and_plain_tensors_take_the_whole_path():
    encoder = StreamEncoder(ENSEMBLE, "r")
    batch = make_outputs([_chunk("a"), _chunk("bc", ids=(1,))], ENSEMBLE)
    assert event(encoder, batch) == reference(ENSEMBLE, "r", batch)
    chosen = select_outputs(make_outputs([_chunk("a")], ENSEMBLE), None, ENSEMBLE)
    assert event(encoder, chosen) == reference(ENSEMBLE, "r", chosen)


ERROR_CASES = {
    "lone surrogate in the text": (ENSEMBLE, "r", lambda: _chunk("a\ud800b")),
    "lone surrogate in the id": (BLS, "\udc80", lambda: _chunk("a")),
    "log prob of a token it does not hold": (
        ENSEMBLE,
        "r",
        lambda: _missing_logprob(_chunk(logprobs=[-1.0, -1.0, -1.0], cum=-3.0)),
    ),
    "sequence index past int32": (ENSEMBLE, "r", lambda: _chunk(sequence_index=2**31)),
    "token id past int32": (TRTLLM, "r", lambda: _chunk("", ids=(1, 2**31))),
    "no completion": (ENSEMBLE, "r", lambda: _no_completion(_chunk())),
}


def _missing_logprob(chunk: Chunk) -> Chunk:
    chunk.out.outputs[0].logprobs[1] = {999: Logprob(-1.0)}
    return chunk


def _no_completion(chunk: Chunk) -> Chunk:
    chunk.out.outputs.clear()
    return chunk


@pytest.mark.parametrize("model, request_id, case", ERROR_CASES.values(), ids=ERROR_CASES.keys())
def test_what_the_whole_path_raises_it_raises(model, request_id, case):
    with pytest.raises(Exception) as old:
        reference(model, request_id, make_outputs([case()], model))
    with pytest.raises(type(old.value)) as new:
        event(StreamEncoder(model, request_id), make_outputs([case()], model))
    assert str(new.value) == str(old.value)


# ---- a whole stream, as run.stream cuts it -------------------------------------------------------------

PIECES = ["He", "llo", "", " wor", 'ld "😀"\n', ""]


@pytest.mark.parametrize("model", (*TEXT_MODELS, TRTLLM))
@pytest.mark.parametrize("accumulate", (False, True))
@pytest.mark.parametrize("log_probs", (False, True))
def test_a_stream_of_cumulative_outputs(model, accumulate, log_probs):
    req = SimpleNamespace(beam_width=1, model=model, return_log_probs=log_probs, pad_id=0)
    encoder = StreamEncoder(model, "stream-1")
    sent_chars = sent_tokens = events = 0
    text, ids, lps = "", [], []
    for step, piece in enumerate(PIECES):
        text, ids = text + piece, [*ids, 100 + step]
        lps.append({ids[-1]: Logprob(-0.37 * step)})
        last = step == len(PIECES) - 1
        comp = CompletionOutput(
            0, text, list(ids), -0.37 * step, list(lps), "stop" if last else None
        )
        out = RequestOutput("r", "p", [1, 2], [comp], last)
        chunk = triton_run._stream_chunk(req, out, sent_chars, sent_tokens, accumulate)
        if chunk is None:
            continue
        sent_chars, sent_tokens = len(text), len(ids)
        tensors = make_outputs([chunk], model, 16)
        assert event(encoder, tensors) == reference(model, "stream-1", tensors)
        events += 1
    assert events >= len([p for p in PIECES if p]) + 1


# ---- make_outputs' lazy tensors --------------------------------------------------------------------------


def test_outputs_build_on_first_read_in_the_eager_order():
    chunk = _chunk(logprobs=[-0.5, -1.0, -2.0], cum=-3.5)
    tensors = make_outputs([chunk], BLS, 16)
    assert isinstance(tensors, Outputs) and tensors._tensors is None
    assert tensors["text_output"].tolist() == [b" Hello"]
    assert (
        "arrival_time_ns" not in tensors._tensors
    )  # the BLS metrics wait for one of them to be read
    assert tensors["kv_cache_alloc_total_blocks"].tolist() == [[1]]
    assert list(tensors)[:7] == [
        "text_output",
        "cum_log_probs",
        "output_log_probs",
        "context_logits",
        "generation_logits",
        "batch_index",
        "sequence_index",
    ]
    assert len(tensors) == 17 and "arrival_time_ns" in tensors and "nope" not in tensors
    assert "arrival_time_ns" not in make_outputs([chunk], ENSEMBLE, 16)
    np.testing.assert_array_equal(tensors["output_log_probs"], [[[-0.5, -1.0, -2.0]]])


def test_the_generate_document_is_unchanged():
    tensors = select_outputs(make_outputs([_chunk("a")], ENSEMBLE), None, ENSEMBLE)
    assert stream_events.generate_json(ENSEMBLE, "r", tensors) == reference(
        ENSEMBLE, "r", tensors
    ).removeprefix(b"data: ").removesuffix(b"\n\n")
