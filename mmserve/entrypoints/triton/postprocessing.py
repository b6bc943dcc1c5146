"""The seeds' `postprocessing` model (PROTOCOL §1.6): token ids back to text. TOKENS_BATCH [batch, beams, tokens]
(e.g. `tensorrt_llm`'s output_ids) and SEQUENCE_LENGTH [batch, beams] -> OUTPUT [batch * beams] strings, each
sequence's first SEQUENCE_LENGTH ids decoded by the served tokenizer with the server's skip_special_tokens
(`mmserve serve --no-skip-special-tokens`: the seeds' postprocessing parameter). Prompt-table ids (from the
vocabulary size on: a picture's rows, `preprocessing`'s fake ids) stand for no text and decode to nothing."""

from __future__ import annotations

import asyncio

import numpy as np

from mmserve.entrypoints.state import ServerState


async def detokenize(
    state: ServerState, tensors: dict[str, np.ndarray], batch: int
) -> dict[str, np.ndarray]:
    """Checked input tensors (aux_models.checked_inputs) -> OUTPUT."""
    tokens, lengths = tensors["TOKENS_BATCH"], tensors["SEQUENCE_LENGTH"]
    if lengths.shape[1] != tokens.shape[1]:
        raise ValueError(
            f"SEQUENCE_LENGTH: {lengths.shape[1]} lengths per batch item for TOKENS_BATCH's "
            f"{tokens.shape[1]} beams"
        )
    width = tokens.shape[2]
    if (lengths < 0).any() or (lengths > width).any():
        raise ValueError(
            f"SEQUENCE_LENGTH: lengths must be in [0, {width}] (TOKENS_BATCH's tokens), "
            f"got {lengths.reshape(-1).tolist()}"
        )
    rows = []
    for b in range(batch):
        for k in range(tokens.shape[1]):
            ids = tokens[b, k, : int(lengths[b, k])]
            if (ids < 0).any():
                raise ValueError(f"TOKENS_BATCH: negative token id in batch item {b}, beam {k}")
            rows.append(ids)
    vocab, skip = state.engine.model_info.vocab_size, state.config.skip_special_tokens
    tokenizer = state.engine.tokenizer

    def decode() -> list[bytes]:
        return [
            tokenizer.decode([int(t) for t in ids if t < vocab], skip_special_tokens=skip).encode()
            for ids in rows
        ]

    texts = await asyncio.to_thread(decode)  # long batches: off the event loop
    out = np.empty(len(texts), dtype=np.object_)
    out[:] = texts
    return {"OUTPUT": out}
