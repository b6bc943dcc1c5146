"""BoundedLRU: the caches of recent inputs, bounded in entries and in bytes, and the byte counts of what they keep
(tensors, ProcessedInputs)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from mmserve.core.multimodal import ProcessedInputs


class BoundedLRU:
    """An LRU cache of at most `max_entries` entries and `max_bytes` bytes, as `size_of(value)` counts them (a value
    larger than max_bytes is not kept). Not locked: InputProcessor holds its _recent_lock around every call."""

    def __init__(self, max_entries: int, max_bytes: int, size_of: Callable[[Any], int]) -> None:
        self.max_entries, self.max_bytes, self._size_of = max_entries, max_bytes, size_of
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = (
            OrderedDict()
        )  # least recently used first
        self.nbytes = 0

    def get(self, key: Hashable) -> Any | None:
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def put(self, key: Hashable, value: Any) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        size = self._size_of(value)
        if size > self.max_bytes:
            return
        self._entries[key] = (value, size)
        self.nbytes += size
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.nbytes -= dropped

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def tensor_bytes(values: Iterable[Any]) -> int:
    """The bytes of the tensors among `values` (other values count nothing)."""
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


def inputs_bytes(inputs: ProcessedInputs) -> int:
    """What a ProcessedInputs holds: its encoder inputs, M-RoPE positions and prompt ids (a list of Python ints:
    a pointer and an int object each)."""
    n = 40 * len(inputs.prompt_token_ids) + sum(
        tensor_bytes(m.data.values()) for m in inputs.mm_items
    )
    return n + (inputs.prompt_positions.nbytes if inputs.prompt_positions is not None else 0)
