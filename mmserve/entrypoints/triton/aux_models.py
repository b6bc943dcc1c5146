"""The seeds' other Triton models, `preprocessing`, `multimodal_encoders` and `postprocessing` (PROTOCOL §1.3, §1.4,
§1.6), for clients that call them directly, e.g. to build a prompt embedding table for `tensorrt_llm` themselves.
This module checks their input tensors against the specs in models.py (names, datatypes, shapes, max_batch_size),
runs the model (`preprocessing.py`, `multimodal_encoders.py`, `postprocessing.py`), counts it in the statistics
extension and picks the outputs the request asked for. Each answers one response, over KServe infer (REST and
gRPC, ModelStreamInfer included)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import numpy as np

from mmserve.entrypoints.state import ServerDraining, ServerState
from mmserve.entrypoints.triton.models import (
    AUX_INPUTS,
    AUX_OUTPUTS,
    MM_ENCODERS,
    POSTPROCESSING,
    PREPROCESSING,
)
from mmserve.entrypoints.triton.multimodal_encoders import encode_pictures, picture_input
from mmserve.entrypoints.triton.postprocessing import detokenize
from mmserve.entrypoints.triton.preprocessing import preprocess
from mmserve.entrypoints.triton.requests import check_tensor

AUX_MODELS = (PREPROCESSING, MM_ENCODERS, POSTPROCESSING)
Runner = Callable[[ServerState, dict[str, np.ndarray], int], Awaitable[dict[str, np.ndarray]]]
_RUNNERS: dict[str, Runner] = {
    PREPROCESSING: preprocess,
    MM_ENCODERS: encode_pictures,
    POSTPROCESSING: detokenize,
}
# why a declared output is missing from an answer (the seeds declare every model type's outputs)
_NOT_PRODUCED = {
    "DECODER_INPUT_ID": "an encoder-decoder's prompt is its decoder's here: INPUT_ID",
    "REQUEST_DECODER_INPUT_LEN": "an encoder-decoder's prompt is its decoder's here: REQUEST_INPUT_LEN",
    "OUT_PROMPT_TABLE_EXTRA_IDS": "only with PROMPT_TABLE_EXTRA_ID and pictures",
    "PIXEL_VALUES": "only with pictures this model's processor turns into one [3, H, W] tensor each",
}


def checked_inputs(
    state: ServerState, model: str, tensors: dict[str, np.ndarray], batch_input: str | None = None
) -> tuple[dict[str, np.ndarray], int]:
    """(the inputs given, the batch size): empty tensors count as absent (clients send them for unused optional
    inputs); unknown names, missing required inputs, datatypes, shapes and the batch size (1 to the model's
    max_batch_size, the same for every input) raise ValueError naming the input."""
    specs = {s.name: s for s in AUX_INPUTS[model]}
    for name in tensors:
        if name not in specs:
            raise ValueError(f"unexpected inference input '{name}' for model '{model}'")
    present = {k: v for k, v in tensors.items() if v.size > 0}
    for spec in specs.values():
        if not spec.optional and spec.name not in present:
            raise ValueError(f"{spec.name} is required")
    if batch_input is None:
        batch_input = next(s.name for s in specs.values() if not s.optional)
    first = present[batch_input]
    batch = first.shape[0] if first.ndim else 0
    limit = state.config.max_batch_size  # what the model config reports (--max-num-seqs)
    if not 1 <= batch <= limit:
        raise ValueError(
            f"{batch_input}: batch size must be in [1, {limit}] (the model's max_batch_size), "
            f"got {batch}"
        )
    for name, arr in present.items():
        check_tensor(model, name, arr, batch, specs, batch_input=batch_input)
    return present, batch


def select_aux_outputs(
    model: str, produced: dict[str, np.ndarray], requested: list[str] | None
) -> dict[str, np.ndarray]:
    """The outputs a request asked for, in its order (all produced ones, in the config's order, when it named
    none); a declared output this answer lacks is a ValueError saying why."""
    declared = [s.name for s in AUX_OUTPUTS[model]]
    if not requested:
        return {name: produced[name] for name in declared if name in produced}
    for name in requested:
        if name not in declared:
            raise ValueError(f"unexpected inference output '{name}' for model '{model}'")
        if name not in produced:
            why = _NOT_PRODUCED.get(name, "it belongs to model types this server's family is not")
            raise ValueError(f"{name}: not produced by '{model}' for this request ({why})")
    return {name: produced[name] for name in dict.fromkeys(requested)}


async def run_aux(
    state: ServerState,
    model: str,
    tensors: dict[str, np.ndarray],
    requested: list[str] | None = None,
) -> dict[str, np.ndarray]:
    """One request to `preprocessing`, `multimodal_encoders` or `postprocessing`: its output tensors (batch
    first). Bad input raises ValueError naming the tensor (HTTP 400 / INVALID_ARGUMENT)."""
    if state.draining:
        raise ServerDraining("the server is shutting down and takes no new requests")
    batch_input = picture_input(tensors) if model == MM_ENCODERS else None
    present, batch = checked_inputs(state, model, tensors, batch_input)
    with state.statistics.execution(model, batch):
        produced = await _RUNNERS[model](state, present, batch)
        return select_aux_outputs(model, produced, requested)
