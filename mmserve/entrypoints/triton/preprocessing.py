"""The seeds' `preprocessing` model (PROTOCOL §1.3, §6, §7): QUERY and its pictures -> the token-level inputs of
`tensorrt_llm` (INPUT_ID, word lists, embedding bias, end / pad ids) and the pictures' pixels for
`multimodal_encoders`.

The prompt is the ensemble's: the inputs are renamed to the ensemble's and parsed by protocol.parse_request (the
family's pre / post prompt and placeholders, every picture input), then tokenized by AsyncEngine.preprocess (the
served processor), so INPUT_ID holds the very ids the ensemble runs. As in the seeds, each picture's placeholder
run becomes fake prompt ids from the vocabulary size V on (V, V+1, ... over the request's pictures in order): the
rows of the table `multimodal_encoders` returns for the same pictures, which `tensorrt_llm` takes as
`prompt_embedding_table`. Families whose pictures have no such table (M-RoPE, CogVLM's own positions,
cross-attention, encoder-decoders: multimodal_encoders.no_table_reason) keep the processor's placeholder ids."""

from __future__ import annotations

import asyncio
import re

import numpy as np

from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton import protocol as tp
from mmserve.entrypoints.triton.models import ENSEMBLE
from mmserve.entrypoints.triton.multimodal_encoders import no_table_reason
from mmserve.entrypoints.triton.requests import TritonRequest
from mmserve.multimodal.prompt_table import MODALITY as TABLE_MODALITY

# the preprocessing model's inputs as the ensemble names them (its config routes them so, PROTOCOL §1.1)
TO_ENSEMBLE = {
    "QUERY": "text_input",
    "DECODER_QUERY": "decoder_text_input",
    "IMAGE_BYTES": "image_bytes_input",
    "IMAGE_URL": "image_url_input",
    "IMAGE_SIZES": "image_sizes_input",
    "VIDEO_BYTES": "video_bytes_input",
    "REQUEST_OUTPUT_LEN": "max_tokens",
    "BAD_WORDS_DICT": "bad_words",
    "STOP_WORDS_DICT": "stop_words",
    "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
    "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
    "END_ID": "end_id",
    "PAD_ID": "pad_id",
    "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
}
_FROM_ENSEMBLE = {v: k for k, v in TO_ENSEMBLE.items()}
_ENSEMBLE_NAME = re.compile(r"\b(" + "|".join(_FROM_ENSEMBLE) + r")\b")


def own_names(message: str) -> str:
    """An ensemble-side message with the preprocessing model's input names."""
    return _ENSEMBLE_NAME.sub(lambda m: _FROM_ENSEMBLE[m.group(1)], message)


async def preprocess(
    state: ServerState, tensors: dict[str, np.ndarray], batch: int
) -> dict[str, np.ndarray]:
    """Checked input tensors (aux_models.checked_inputs) -> every output this request produces."""
    try:
        reqs = await tp.parse_request(
            state, ENSEMBLE, {TO_ENSEMBLE[k]: v for k, v in tensors.items()}
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(own_names(str(exc))) from exc
    processed = await asyncio.gather(*(_processed(state, r) for r in reqs))
    vocab = state.engine.model_info.vocab_size
    table = no_table_reason(state.engine.model_info.family) is None
    rows = [_table_ids(p, vocab) if table else list(p.prompt_token_ids) for p in processed]
    end_ids = [_end_id(state, r) for r in reqs]
    pad_ids = [_pad_id(state, tensors, b, end_ids[b]) for b in range(batch)]
    out = {
        "INPUT_ID": _padded(rows, pad_ids, np.int32),
        "REQUEST_INPUT_LEN": np.array([[len(r)] for r in rows], np.int32),
        "BAD_WORDS_IDS": _word_lists(state, [r.params.bad_words or [] for r in reqs]),
        "STOP_WORDS_IDS": _word_lists(state, [r.params.stop or [] for r in reqs]),
        "EMBEDDING_BIAS": _embedding_bias([r.params.logit_bias for r in reqs], vocab),
        "REQUEST_OUTPUT_LEN": tensors["REQUEST_OUTPUT_LEN"].reshape(batch, 1).astype(np.int32),
        "OUT_END_ID": np.array(end_ids, np.int32).reshape(batch, 1),
        "OUT_PAD_ID": np.array(pad_ids, np.int32).reshape(batch, 1),
        "IS_VIDEO_INPUT": np.full((batch, 1), "VIDEO_BYTES" in tensors),
    }
    if "PROMPT_TABLE_EXTRA_ID" in tensors and table and any(p.mm_items for p in processed):
        extra = tensors["PROMPT_TABLE_EXTRA_ID"].reshape(batch).astype(np.uint64)
        marked = [[int(extra[b]) if t >= vocab else 0 for t in r] for b, r in enumerate(rows)]
        out["OUT_PROMPT_TABLE_EXTRA_IDS"] = _padded(marked, [0] * batch, np.uint64)
    pixels = _pixel_values(processed)
    if pixels is not None:
        out["PIXEL_VALUES"] = pixels
    return out


async def _processed(state: ServerState, req: TritonRequest):
    """The item's ProcessedInputs, as the ensemble's request gets them (AsyncEngine.generate's preprocess)."""
    try:
        return await state.engine.preprocess(req.prompt)
    except (ValueError, TypeError) as exc:
        raise ValueError(own_names(tp.rename_fields(str(exc), req))) from exc


def _table_ids(inputs, vocab: int) -> list[int]:
    """The prompt with each picture's run of placeholder ids replaced by its prompt-table ids (from V on)."""
    ids, row = list(inputs.prompt_token_ids), vocab
    for item in inputs.mm_items:
        if item.modality != TABLE_MODALITY:
            ids[item.offset : item.end] = range(row, row + item.length)
            row += item.length
    return ids


def _end_id(state: ServerState, req: TritonRequest) -> int:
    """END_ID when given (>= 0), else the tokenizer's EOS, as the ensemble's request stops on."""
    if req.params.eos_token_id is not None:
        return int(req.params.eos_token_id)
    eos = state.engine.tokenizer.eos_token_id
    return 0 if eos is None else int(eos)


def _pad_id(state: ServerState, tensors: dict[str, np.ndarray], b: int, end_id: int) -> int:
    """PAD_ID when given, else the tokenizer's pad token, else the end id (PROTOCOL §6)."""
    if "PAD_ID" in tensors:
        return int(tensors["PAD_ID"].reshape(len(tensors["PAD_ID"]), -1)[b, 0])
    pad = state.engine.tokenizer.pad_token_id
    return end_id if pad is None else int(pad)


def _padded(rows: list[list[int]], fill: list[int], dtype) -> np.ndarray:
    """[batch, longest] with each row right-padded by its own fill value."""
    width = max(len(r) for r in rows)
    out = np.empty((len(rows), width), dtype)
    for b, r in enumerate(rows):
        out[b] = fill[b]
        out[b, : len(r)] = r
    return out


def _word_lists(state: ServerState, words: list[list[str]]) -> np.ndarray:
    """TensorRT-LLM's [batch, 2, L] word lists: row 0 each word's ids (no special tokens) end to end, padded with
    0; row 1 the words' end offsets, padded with -1; [batch, 2, 0] when no item has one (PROTOCOL §6)."""
    tokenizer = state.engine.tokenizer
    flat, ends = [], []
    for item in words:
        ids: list[int] = []
        offsets: list[int] = []
        for word in item:
            word_ids = tokenizer.encode(word, add_special_tokens=False)
            if word_ids:
                ids += word_ids
                offsets.append(len(ids))
        flat.append(ids)
        ends.append(offsets)
    if not any(flat):
        return np.empty((len(words), 2, 0), np.int32)
    width = max(len(ids) for ids in flat)
    out = np.empty((len(words), 2, width), np.int32)
    out[:, 0], out[:, 1] = 0, -1
    for b, (ids, offsets) in enumerate(zip(flat, ends)):
        out[b, 0, : len(ids)] = ids
        out[b, 1, : len(offsets)] = offsets
    return out


def _embedding_bias(biases: list[dict[int, float] | None], vocab: int) -> np.ndarray:
    """[batch, vocab] fp32 (each word's weight on every id it tokenizes to), [batch, 0] when no item has one."""
    if not any(biases):
        return np.empty((len(biases), 0), np.float32)
    out = np.zeros((len(biases), vocab), np.float32)
    for b, bias in enumerate(biases):
        for tok, weight in (bias or {}).items():
            out[b, tok] = weight
    return out


def _pixel_values(processed: list) -> np.ndarray | None:
    """PIXEL_VALUES [batch, pictures, 3, H, W] fp16, what multimodal_encoders takes as IMAGE; None unless every
    item has pictures of one [3, H, W] shape, the same number each (other layouts: send the pictures)."""
    per_item = [
        [m.data.get("pixel_values") for m in p.mm_items if m.modality == "image"] for p in processed
    ]
    if not per_item[0] or any(len(px) != len(per_item[0]) for px in per_item):
        return None
    flat = [px for item in per_item for px in item]
    if any(px is None or px.dim() != 3 or px.shape != flat[0].shape for px in flat):
        return None
    stacked = [np.stack([px.float().cpu().numpy() for px in item]) for item in per_item]
    return np.stack(stacked).astype(np.float16)
