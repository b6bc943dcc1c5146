"""EncoderCache: vision-encoder outputs kept by content hash (LRU, bounded in embedding rows)."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._size = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> torch.Tensor | None:
        emb = self._entries.get(key)
        if emb is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return emb

    def put(self, key: str, emb: torch.Tensor) -> None:
        """Keep emb [length, hidden]; evict least recently used entries beyond capacity."""
        if key in self._entries:
            return
        self._entries[key] = emb
        self._size += len(emb)
        while self._size > self.capacity and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._size -= len(old)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._size = 0
