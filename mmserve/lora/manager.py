"""LoRAManager: the engine's loaded LoRA adapters and their application to a step's rows.

Adapters load by name (`add`); a request names one in its prompt (`{"lora": name}`). Every linear layer an adapter
targets gets a forward hook; during a step (`step(groups)`), the hook adds each adapter's delta to the output
rows of that adapter's sequences, so requests with different adapters and without one share a batch. Outside a
step the hooks do nothing (CUDA graph captures, encoders). Steps with LoRA rows run eagerly (no CUDA graphs).
"""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from mmserve.layers.linear import LinearBase
from mmserve.lora.adapter import LoRAAdapter

# rows of one adapter in a step: (adapter, row indices [R] on the device)
RowGroup = tuple[LoRAAdapter, torch.Tensor]


class LoRAManager:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, max_loras: int = 8) -> None:
        self.model, self.device, self.dtype, self.max_loras = model, device, dtype, max_loras
        self.adapters: dict[str, LoRAAdapter] = {}
        self._groups: list[RowGroup] | None = None
        self._hooked: set[str] = set()

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load the PEFT adapter at `path` as `name` (replacing one of that name). ValueError if it does not fit."""
        if not name or not isinstance(name, str):
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name not in self.adapters and len(self.adapters) >= self.max_loras:
            raise ValueError(f"{len(self.adapters)} LoRA adapters are loaded already (max_loras {self.max_loras})")
        for _, module in self._linears():
            if module.is_fp8:
                raise ValueError("LoRA adapters on FP8 weights are not supported")
        adapter = LoRAAdapter.load(name, path, self.model, self.device, self.dtype)
        for module_name in adapter.targets:
            if module_name not in self._hooked:
                self.model.get_submodule(module_name).register_forward_hook(self._hook(module_name))
                self._hooked.add(module_name)
        self.adapters[name] = adapter
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"lora: unknown LoRA adapter {name!r} (loaded: {loaded})")
        return adapter

    def hash_salt(self, name: str | None) -> bytes | None:
        """The parent digest of a request's first KV block: the adapter changes every block's keys and values."""
        if name is None:
            return None
        return hashlib.sha256(b"lora\0" + self.get(name).digest.encode()).digest()

    @contextlib.contextmanager
    def step(self, groups: list[RowGroup]) -> Iterator[None]:
        """Apply `groups` (adapter, its rows of the flat batch) in the forward passes run inside."""
        self._groups = groups or None
        try:
            yield
        finally:
            self._groups = None

    def _hook(self, module_name: str):
        def add_deltas(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if self._groups is None:
                return None
            x = inputs[0]
            for adapter, rows in self._groups:
                for t in adapter.targets.get(module_name, ()):
                    delta = (x[rows] @ t.a.T) @ t.b.T
                    output[rows, t.offset:t.offset + t.size] += delta.to(output.dtype)
            return output
        return add_deltas

    def _linears(self) -> Iterator[tuple[str, LinearBase]]:
        for name, module in self.model.named_modules():
            if isinstance(module, LinearBase) and name.startswith("language_model."):
                yield name, module
