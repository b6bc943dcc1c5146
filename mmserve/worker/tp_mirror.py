"""A tensor-parallel worker's replay of the driver's forward passes (worker/tp_workers.py).

The driver's ModelRunner decides each step's kind of pass (a decode graph, a prefill graph, piecewise graphs or
eager) and sends it with the step's host-side layout; its device inputs arrive by broadcast from rank 0 (for
Mllama also the states of the pictures the step writes to the cross-attention pool, whose keys/values each rank
projects for its own heads). The worker runs the same pass over its own shard of the model, so the all-reduces
inside meet the driver's. `lora_sync`
applies the driver's LoRA adapter changes to the worker's slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmserve.core.transfer import to_device
from mmserve.distributed import tp_broadcast
from mmserve.worker.batch_inputs import attention_metadata
from mmserve.worker.request_inputs import cross_batch_from_host

if TYPE_CHECKING:
    from mmserve.worker.model_runner import ModelRunner


@dataclass
class _SeqLayout:
    """What attention_metadata reads of a scheduled sequence."""

    block_ids: list[int]
    num_tokens: int


def run_mirrored(runner: ModelRunner, kind: str, host: tuple, specs: list) -> None:
    """Receive the broadcast inputs described by `specs` ((shape, dtype) each) and run pass `kind` on them."""
    tensors = [
        tp_broadcast(torch.empty(shape, dtype=dtype, device=runner.device))
        for shape, dtype in specs
    ]
    if kind == "decode":
        input_ids, positions, slots, seq_lens, tables, cross = host
        runner.graphs.run(
            input_ids,
            positions,
            slots,
            seq_lens,
            tables,
            tuple(tensors) if tensors else None,
            cross,
        )
        return
    positions, slots, qsl, seq_lens, tables, rows_by_adapter, cross_host = host
    embeds = tensors[0]
    if kind == "prefill":
        runner.prefill_graphs.run(embeds, positions, slots, qsl, seq_lens, tables)
        return
    seqs = [_SeqLayout(t, qsl[i + 1] - qsl[i]) for i, t in enumerate(tables)]
    if kind == "piecewise":
        meta = attention_metadata(
            seqs,
            slots,
            qsl,
            seq_lens,
            runner.block_size,
            runner.device,
            runner.piecewise_graphs.inputs.slot_mapping[: len(slots)],
        )
        runner.piecewise_graphs.run(embeds, positions, slots, meta)
        return
    meta = attention_metadata(seqs, slots, qsl, seq_lens, runner.block_size, runner.device)
    if cross_host is not None:  # Mllama: the step's new pictures' states follow the embeddings
        meta.cross = cross_batch_from_host(
            cross_host, tensors[1:], runner.model, runner.cross_kv, runner.attn_layers[0].backend
        )
    runner.run_eager(
        embeds, to_device(positions, torch.int64, runner.device), meta, rows_by_adapter
    )


def lora_sync(runner: ModelRunner, removed: list[str], name: str, source, evictable: bool) -> None:
    """A tensor-parallel worker's copy of the driver's adapter change: unload `removed`, then load `name` from a
    PEFT directory (`source` a path) or TensorRT-LLM tensors (`source` (weights, config)), sharded for this
    rank."""
    from mmserve.lora.adapter import LoRAAdapter
    from mmserve.lora.trtllm_format import adapter_from_trtllm

    for gone in removed:
        runner.lora.remove(gone)
    adapter = (
        LoRAAdapter.load(name, source, runner.model, runner.device, runner.dtype)
        if isinstance(source, str)
        else adapter_from_trtllm(name, *source, runner.model, runner.device, runner.dtype)
    )
    runner.lora.install(adapter, evictable)
