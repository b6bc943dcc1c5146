"""A tensor-parallel worker's side of the driver's steps (worker/tp_workers.py): the tensors of each pass by
broadcast from rank 0 (the pass itself is `step_execution.execute_step`, the same on every rank), and
`lora_sync`, the driver's LoRA adapter changes applied to the worker's slices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmserve.distributed import tp_broadcast

if TYPE_CHECKING:
    from mmserve.worker.model_runner import ModelRunner
    from mmserve.worker.step_execution import StepInputs


def receive_step_tensors(inputs: StepInputs, device: torch.device) -> list[torch.Tensor]:
    """The device tensors of a pass, as rank 0 broadcasts them after sending `inputs`."""
    return [
        tp_broadcast(torch.empty(shape, dtype=dtype, device=device))
        for shape, dtype in inputs.tensors
    ]


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
