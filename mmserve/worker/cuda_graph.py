"""DecodeGraphs: CUDA graphs of the decode step (embed -> LM -> logits) at bucketed batch sizes.

Inputs live in persistent device buffers; a replay copies the step's ids, positions, slots, context
lengths and block tables into them, pads the rest of the bucket (slot -1, context 0) and reads the
logits of the real rows. Needs an attention backend without host syncs (the Triton one).
"""
from __future__ import annotations

import bisect

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata


def default_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: nn.Module, device: torch.device, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, max_model_len: int, buckets: list[int] | None = None, mrope: bool = False) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = buckets or default_buckets(max_num_seqs)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros((3, n) if mrope else (n,), dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[self.max_model_len] * b,
            max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size)

    def _forward(self, b: int) -> torch.Tensor:
        embeds = self.model.embed_input_ids(self.input_ids[:b])
        hidden = self.model(embeds, self.positions[..., :b], self._meta(b))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first so smaller ones reuse its memory pool."""
        for b in reversed(self.buckets):
            self._forward(b)                    # warm up (Triton autotune/compile) outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[b] = self._forward(b)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def run(self, input_ids: list[int], positions: torch.Tensor, slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Replay the smallest bucket that fits; returns logits [len(input_ids), V] (a view).

        positions: [n] or [3, n] (M-RoPE) int64 on the host.
        """
        n = len(input_ids)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        width = self.block_tables.shape[1]
        host = torch.zeros(3, b, dtype=torch.int64)
        host[0, :n] = torch.tensor(input_ids)
        host[1, :] = -1
        host[1, :n] = torch.tensor(slots)
        host[2, :n] = torch.tensor(seq_lens)
        pos = torch.zeros(*positions.shape[:-1], b, dtype=torch.int64)
        pos[..., :n] = positions
        tables = torch.zeros(b, width, dtype=torch.int32)
        for i, row in enumerate(block_tables):
            tables[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        host = host.pin_memory().to(self.device, non_blocking=True)
        self.input_ids[:b].copy_(host[0])
        self.positions[..., :b].copy_(pos.pin_memory().to(self.device, non_blocking=True))
        self.slot_mapping[:b].copy_(host[1])
        self.seq_lens[:b].copy_(host[2])
        self.block_tables[:b].copy_(tables.pin_memory().to(self.device, non_blocking=True))
        self.graphs[b].replay()
        return self.logits[b][:n]
