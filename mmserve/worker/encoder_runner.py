"""The vision encoder's room in the runner: its outputs cached by content hash, its CUDA graphs, and the merge of
those outputs into the prompt's embeddings over the placeholder tokens."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from mmserve.core.multimodal import MultiModalItem
from mmserve.core.transfer import cdiv, to_device
from mmserve.multimodal.prompt_table import MODALITY as TABLE_MODALITY
from mmserve.worker.encoder_cache import EncoderCache
from mmserve.worker.encoder_graphs import EncoderGraphs, vision_kernels

if TYPE_CHECKING:
    from mmserve.worker.encoder_sharding import EncoderSharding


class EncoderRunner:
    """Encodes a step's media items: cached embeddings reused, the rest in batches of equal shape, from CUDA
    graphs where the family allows them (`family.encoder_cuda_graphs`)."""

    def __init__(
        self, model: nn.Module, device: torch.device, dtype: torch.dtype, cache_size: int
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.cache = EncoderCache(cache_size)
        self.graphs: EncoderGraphs | None = None
        # --mm-encoder-tp-mode data, on the driver: cache misses encoded over every rank (encoder_sharding.py)
        self.sharding: EncoderSharding | None = None
        self.items_encoded = 0  # items this rank's tower encoded (stats, tests)

    def capture_graphs(self, template: MultiModalItem | None, max_num_batched_tokens: int) -> None:
        """Replay the encoder from CUDA graphs (CUDA only); with a template item, capture its shapes now for
        every batch a step can encode (a step of max_num_batched_tokens overlaps at most cdiv(tokens, item
        length) + 1 items), other shapes on first use."""
        if self.device.type != "cuda" or not self.model.family.encoder_cuda_graphs:
            return
        self.graphs = EncoderGraphs(self.model, self.device)
        if template is not None:
            with self.kernels():  # a graph keeps the kernels chosen while it was captured
                self.graphs.warm_up(
                    self.on_device(template), cdiv(max_num_batched_tokens, template.length) + 1
                )

    def merge(self, computed: list, qsl: list[int], embeds: torch.Tensor) -> None:
        """Overwrite placeholder-token embeddings with the encoder's outputs for this chunk (request i's rows of
        `embeds` start at qsl[i])."""
        spans = []  # (flat dst, item, src offset in item, count)
        for i, s in enumerate(computed):
            for item in s.request.mm_items_in(s.start, s.end):
                lo, hi = max(s.start, item.offset), min(s.end, item.end)
                spans.append((qsl[i] + lo - s.start, item, lo - item.offset, hi - lo))
        if not spans:
            return
        encoded = self.encode([item for _, item, _, _ in spans])
        for dst, item, src, n in spans:
            embeds[dst : dst + n] = encoded[item.content_hash][src : src + n].to(embeds.dtype)

    def encode(self, items: list[MultiModalItem]) -> dict[str, torch.Tensor]:
        """Embeddings by content hash: cached ones reused, the rest encoded in batches of equal shape."""
        out: dict[str, torch.Tensor] = {}
        pending: list[MultiModalItem] = []
        for item in items:
            if item.content_hash in out:
                continue
            if (
                item.modality == TABLE_MODALITY
            ):  # a client's prompt table: the embeddings themselves
                out[item.content_hash] = self.on_device(item).data["embeddings"]
                continue
            emb = self.cache.get(item.content_hash)
            if emb is not None:
                out[item.content_hash] = emb
                continue
            out[item.content_hash] = None
            pending.append(item)
        if not pending:
            return out
        if self.sharding is not None:
            embeddings = self.sharding.encode(self, pending)
        else:
            embeddings = self.encode_uncached(pending)
        for item, emb in zip(pending, embeddings):
            out[item.content_hash] = emb
            self.cache.put(item.content_hash, emb)
        return out

    def encode_uncached(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode `items` here, without the cache: batches of equal shape, in order."""
        groups: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            key = (item.modality,) + tuple(
                (k, tuple(v.shape)) for k, v in sorted(item.data.items())
            )
            groups.setdefault(key, []).append(i)
        out: list[torch.Tensor | None] = [None] * len(items)
        for group in groups.values():
            moved = [self.on_device(items[i]) for i in group]
            with self.kernels():
                if self.graphs is not None:
                    embeddings = self.graphs.encode(moved)
                else:
                    embeddings = self.model.get_mm_embeddings(moved)
            for i, emb in zip(group, embeddings):
                out[i] = emb
        self.items_encoded += len(items)
        return out

    def kernels(self) -> contextlib.AbstractContextManager:
        """encoder_graphs.vision_kernels for this model's dtype."""
        return vision_kernels(self.dtype)

    def on_device(self, item: MultiModalItem) -> MultiModalItem:
        """`item` with its floating encoder inputs on the device in the model's dtype, copied without a host sync;
        integer ones (grid and image sizes, which models read as shapes) stay on the host, where the
        preprocessing put them, so reading them never waits for the steps queued on the GPU."""
        data = {}
        for k, v in item.data.items():
            if not v.is_floating_point():
                data[k] = v
            elif v.device.type == "cpu" and self.device.type == "cuda":
                data[k] = to_device(
                    v, self.dtype, self.device
                )  # pinned: a pageable copy would sync
            else:
                data[k] = v.to(self.device, self.dtype)
        return dataclasses.replace(item, data=data)
