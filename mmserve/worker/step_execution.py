"""One forward pass of a step, the same on every tensor-parallel rank (SPMD).

Rank 0's runner decides the pass and lays its inputs out as one `StepInputs` (host values) plus the device tensors
that go with it; under tensor parallelism it sends both to the workers (the dataclass by pipe, the tensors by
broadcast) and every rank, itself included, runs `execute_step` on them. Only the driver embeds the prompt and
merges the pictures into it (workers hold the language model alone, or with `--mm-encoder-tp-mode data` encode a
share of the pictures beforehand: encoder_sharding.py), so the embeddings travel as the first tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmserve.core.transfer import to_device
from mmserve.worker.batch_inputs import attention_metadata
from mmserve.worker.request_inputs import cross_batch_from_host

if TYPE_CHECKING:
    from mmserve.worker.model_runner import ModelRunner

STEP_PASSES = (
    "decode",
    "prefill",
    "piecewise",
    "eager",
)  # decode / prefill / piecewise graphs, or none


@dataclass
class StepInputs:
    """The host side of one forward pass; `tensors` (shape, dtype each) follow by broadcast."""

    kind: str  # one of STEP_PASSES
    positions: torch.Tensor  # [T] or [3, T] (M-RoPE) int64 on the host
    slots: list[int]
    qsl: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    input_ids: list[int] | None = (
        None  # decode graphs embed the ids themselves; other passes get embeddings
    )
    rows_by_adapter: dict[str, list[int]] = field(default_factory=dict)
    media_rows: list[int] = field(
        default_factory=list
    )  # eager passes of FamilySpec.media_rows families
    # decode: the cross-attention pool's blocks and lengths of each row; eager: the step's new pictures' states
    # (CrossStepHost.for_workers), whose keys/values every rank projects for its own heads
    cross: Any = None
    tensors: list[tuple[tuple[int, ...], torch.dtype]] = field(default_factory=list)
    padded_tables: np.ndarray | None = (
        None  # block_tables padded (FlatBatch.padded_tables), if at hand
    )


def execute_step(
    runner: ModelRunner, inputs: StepInputs, tensors: list[torch.Tensor], cross_meta: Any = None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(logits or None, final hidden states) of the pass `inputs.kind` over `tensors` (decode: the fill rows and
    ids of tokens the previous step sampled, if any; else the embeddings, then a cross-attention family's new
    picture states). `cross_meta`: the driver's own cross-attention batch (it encoded the pictures)."""
    if inputs.kind == "decode":
        fill = (tensors[0], tensors[1]) if tensors else None
        return runner.graphs.run(
            inputs.input_ids,
            inputs.positions,
            inputs.slots,
            inputs.seq_lens,
            inputs.block_tables,
            fill,
            inputs.cross,
        )
    embeds = tensors[0]
    if inputs.kind == "prefill":
        hidden = runner.prefill_graphs.run(
            embeds,
            inputs.positions,
            inputs.slots,
            inputs.qsl,
            inputs.seq_lens,
            inputs.block_tables,
        )
        return None, hidden
    meta_args = (
        inputs.block_tables,
        inputs.slots,
        inputs.qsl,
        inputs.seq_lens,
        runner.block_size,
        runner.device,
    )
    if inputs.kind == "piecewise":
        # the graphs write the cache through their own slot buffer (filled by run): no copy of the slots here
        slot_buffer = runner.piecewise_graphs.inputs.slot_mapping[: len(inputs.slots)]
        meta = attention_metadata(*meta_args, slot_buffer, inputs.padded_tables)
        return None, runner.piecewise_graphs.run(embeds, inputs.positions, inputs.slots, meta)
    meta = attention_metadata(*meta_args, padded=inputs.padded_tables)
    if cross_meta is not None:
        meta.cross = cross_meta
    elif inputs.cross is not None:
        meta.cross = cross_batch_from_host(
            inputs.cross, tensors[1:], runner.model, runner.cross_kv, runner.attn_layers[0].backend
        )
    if inputs.media_rows:
        taken = set(inputs.media_rows)
        text = [r for r in range(len(inputs.slots)) if r not in taken]
        meta.media_rows = to_device(inputs.media_rows, torch.int64, runner.device)
        meta.text_rows = to_device(text, torch.int64, runner.device)
    positions = to_device(inputs.positions, torch.int64, runner.device)
    return None, runner.run_eager(embeds, positions, meta, inputs.rows_by_adapter)
