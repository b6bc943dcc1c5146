"""LoRAManager: the engine's loaded LoRA adapters and their application to a step's rows.

Adapters load by name: from a PEFT directory (`add`, pinned for the engine's life) or already built (`put`,
e.g. from TensorRT-LLM tensors sent with a request: evictable, least recently used first); a request names one in
its prompt (`{"lora": name}`). Every linear layer an adapter
targets gets a forward hook; during a step (`step(groups)`), the hook adds each adapter's delta to the output
rows of that adapter's sequences, so requests with different adapters and without one share a batch. Outside a
step the hooks do nothing (CUDA graph captures, encoders). Steps with LoRA rows run eagerly (no CUDA graphs).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from mmserve.distributed import tp_all_reduce
from mmserve.layers.linear import LinearBase, RowParallelLinear
from mmserve.lora.adapter import LoRAAdapter

logger = logging.getLogger(__name__)

# rows of one adapter in a step: (adapter, row indices [R] on the device)
RowGroup = tuple[LoRAAdapter, torch.Tensor]


class LoRAManager:
    def __init__(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype, max_loras: int = 8
    ) -> None:
        self.model, self.device, self.dtype, self.max_loras = model, device, dtype, max_loras
        self.adapters: dict[str, LoRAAdapter] = {}
        self.evictable: OrderedDict[str, None] = (
            OrderedDict()
        )  # installed adapters, least recently used first
        # the loaded names, replaced whole on every change: other threads (the server's) read it while the engine
        # thread loads and evicts
        self.names: tuple[str, ...] = ()
        self._groups: list[RowGroup] | None = None
        self._hooked: set[str] = set()
        if model.builtin_lora is not None:  # a family's own (XComposer2's Partial LoRA): pinned
            self.install(model.builtin_lora, evictable=False)

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load the PEFT adapter at `path` as `name` (replacing one of that name). ValueError if it does not fit."""
        self._check_loadable(name)
        if name not in self.adapters and len(self.adapters) >= self.max_loras:
            raise ValueError(
                f"{len(self.adapters)} LoRA adapters are loaded already (max_loras {self.max_loras})"
            )
        adapter = LoRAAdapter.load(name, path, self.model, self.device, self.dtype)
        self.install(adapter, evictable=False)
        return adapter

    def _check_loadable(self, name: str) -> None:
        """ValueError unless an adapter may be served as `name`: a valid name and unquantized weights."""
        if not name or not isinstance(name, str):
            raise ValueError("a LoRA adapter needs a non-empty name")
        for _, module in self._linears():
            if module.is_fp8:
                raise ValueError("LoRA adapters on FP8 weights are not supported")

    def install(self, adapter: LoRAAdapter, evictable: bool) -> None:
        """Serve a built adapter under its name; `evictable`: `put` may unload it to make room."""
        for module_name in adapter.targets:
            if module_name not in self._hooked:
                self.model.get_submodule(module_name).register_forward_hook(self._hook(module_name))
                self._hooked.add(module_name)
        self.adapters[adapter.name] = adapter
        if evictable:
            self.evictable[adapter.name] = None
        else:
            self.evictable.pop(adapter.name, None)
        self.names = tuple(sorted(self.adapters))

    def put(self, adapter: LoRAAdapter, held: set[str]) -> bool:
        """Install an adapter sent with a request unless its name is loaded already with the same weights (False);
        the same name with other weights is a ValueError. With every slot taken, the least recently used
        evictable adapter that no request holds (`held`) makes room."""
        current = self.adapters.get(adapter.name)
        if current is not None:
            if current.digest != adapter.digest:
                raise ValueError(
                    f"lora_weights: LoRA task {adapter.name} is loaded with other weights"
                )
            self.get(adapter.name)  # most recently used
            return False
        self._check_loadable(adapter.name)  # before anything is evicted for it
        if len(self.adapters) >= self.max_loras:
            victim = next((n for n in self.evictable if n not in held), None)
            if victim is None:
                raise ValueError(
                    f"lora_task_id: all {self.max_loras} LoRA adapter slots (max_loras) hold adapters "
                    "loaded at startup or in use"
                )
            self.remove(victim)
            logger.info("LoRA adapter %r evicted for %r", victim, adapter.name)
        self.install(adapter, evictable=True)
        return True

    def remove(self, name: str) -> None:
        """Unload an adapter (its hooks stay: they apply only the adapters of a step's rows)."""
        del self.adapters[name]
        self.evictable.pop(name, None)
        self.names = tuple(sorted(self.adapters))

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"lora: unknown LoRA adapter {name!r} (loaded: {loaded})")
        if name in self.evictable:
            self.evictable.move_to_end(name)
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
        def add_deltas(
            module: nn.Module, inputs: tuple, output: torch.Tensor
        ) -> torch.Tensor | None:
            if self._groups is None:
                return None
            x = inputs[0]
            # a row-parallel layer's rank holds some input columns: its delta is a partial sum, as its output was
            partial = isinstance(module, RowParallelLinear)
            for adapter, rows in self._groups:
                for t in adapter.targets.get(module_name, ()):
                    delta = (x[rows] @ t.a.T) @ t.b.T
                    if partial:
                        delta = tp_all_reduce(delta)  # identity at TP=1
                    output[rows, t.offset : t.offset + t.size] += delta.to(output.dtype)
            return output

        return add_deltas

    def _linears(self) -> Iterator[tuple[str, LinearBase]]:
        for name, module in self.model.named_modules():
            if isinstance(module, LinearBase) and name.startswith("language_model."):
                yield name, module
