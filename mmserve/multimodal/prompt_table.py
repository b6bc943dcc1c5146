"""Prompt tables: visual features a client computed itself, given with the prompt's token ids, as TensorRT-LLM's
`tensorrt_llm` model takes them (`prompt_embedding_table`, PROTOCOL §1.5).

The table is [F, hidden]: rows in the language model's embedding space (after the vision tower and projector).
A prompt id at or past the vocabulary size V stands for table row `id - V`; each run of such ids becomes one
MultiModalItem whose embeddings are those rows, placed where the run is, exactly as an image's embeddings are
(the model runner takes them as they are instead of running the encoder). Families whose pictures reach the
language model another way (M-RoPE positions from the image grid, cross-attention, an encoder-decoder) refuse it.

A run's identity for the prefix cache is its rows' content, or, when the client names it (TensorRT-LLM's
`prompt_table_extra_ids`: one id per prompt token, non-zero at table positions), that id with the run's table
ids: no hashing of the rows, and the client answers for two requests naming the same id meaning the same rows.
"""

from __future__ import annotations

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.multimodal.hashing import hash_bytes

MODALITY = "embeds"  # the runner passes these items' data["embeddings"] through


def prompt_table_items(
    ids: list[int],
    table,
    hf_config,
    model_cls,
    placeholder_id: int | None,
    extra_ids: list[int] | None = None,
) -> tuple[list[int], list[MultiModalItem]]:
    """(prompt ids with each table id replaced by the family's placeholder id, one item per run of table ids).
    `extra_ids`: per prompt token, the client's identity of the table rows there (0: none; module docstring).
    Raises ValueError naming `prompt_table`, `prompt_token_ids` or `prompt_table_extra_ids` for anything that does
    not fit."""
    if extra_ids is not None and len(extra_ids) != len(ids):
        raise ValueError(
            f"prompt_table_extra_ids: {len(extra_ids)} ids for a prompt of {len(ids)} tokens"
        )
    if model_cls.family.mrope or model_cls.family.own_positions or model_cls.family.cross_attention:
        raise ValueError(
            f"prompt_table: not supported for {model_cls.__name__} (its pictures do not enter the "
            "prompt as embeddings); send the images"
        )
    text_config = getattr(hf_config, "text_config", None) or hf_config
    vocab, hidden = text_config.vocab_size, text_config.hidden_size
    table = torch.as_tensor(table)
    if table.dim() != 2 or table.shape[1] != hidden or not table.is_floating_point():
        raise ValueError(
            f"prompt_table: expected float [rows, {hidden}] (the language model's hidden size), "
            f"got {table.dtype} {list(table.shape)}"
        )
    if not torch.isfinite(table).all():
        raise ValueError("prompt_table: contains NaN or infinite values")
    rows = [t - vocab for t in ids if t >= vocab]
    if not rows:
        raise ValueError(
            f"prompt_token_ids: no id >= the vocabulary size {vocab} marks a prompt_table row"
        )
    if max(rows) >= len(table):
        raise ValueError(
            f"prompt_token_ids: id {vocab + max(rows)} is past the prompt_table's {len(table)} rows "
            f"(ids from {vocab} on index it)"
        )
    fill = placeholder_id if placeholder_id is not None else 0
    new_ids, items, start = [], [], None
    for pos, tok in enumerate(ids + [-1]):  # -1 closes a run at the end
        if tok >= vocab:
            start = pos if start is None else start
        elif start is not None:
            emb = table[torch.tensor([t - vocab for t in ids[start:pos]])].float().contiguous()
            named = extra_ids is not None and all(extra_ids[start:pos])
            key = (
                f"table-id:{extra_ids[start]}:{ids[start]}:{pos - start}"
                if named
                else "table:" + hash_bytes(emb.numpy().tobytes())
            )
            items.append(MultiModalItem(MODALITY, {"embeddings": emb}, start, pos - start, key))
            start = None
        if tok >= 0:
            new_ids.append(fill if tok >= vocab else tok)
    return new_ids, items
