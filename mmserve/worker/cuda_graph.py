"""DecodeGraphs: CUDA graphs of the decode step (embed -> LM -> logits) at bucketed batch sizes.

Inputs live in persistent device buffers; a replay copies the step's ids, positions, slots, context
lengths and block tables into them, pads the rest of the bucket (slot -1, context 0) and reads the
logits of the real rows. Needs an attention backend without host syncs (the Triton one). Cross-attention
families that allow it (`cross_decode_graphs`) get each row's blocks of the cross-attention pool (the ones its
generated token attends, at most `cross_blocks`) and their length the same way; padding rows attend nothing.

Captured with kernels/graph_capture.py, as every graph of mmserve.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata, CrossAttentionBatch, CrossAttentionSeq
from mmserve.kernels.graph_capture import graph_capture


def default_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        buckets: list[int] | None = None,
        mrope: bool = False,
        cross=None,
        cross_blocks: int = 0,
        cross_backend=None,
    ) -> None:
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
        self.cross, self.cross_blocks, self.cross_backend = (
            cross,
            cross_blocks,
            cross_backend,
        )  # CrossKVPool
        self.cross_seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.cross_tables = torch.zeros(n, max(cross_blocks, 1), dtype=torch.int32, device=device)
        # pinned host staging in two sets used in turn: with async scheduling the host fills one set
        # while the previous step's copies out of the other may still be queued; an event per set says
        # when its copies ran
        self._staging = [
            _Staging(n, self.positions.shape, max_blocks_per_seq, self.cross_tables.shape[1])
            for _ in range(2)
        ]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden: dict[
            int, torch.Tensor
        ] = {}  # the LM's final hidden states (lm_head's input), per bucket
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _meta(self, b: int) -> AttentionMetadata:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=[self.max_model_len] * b,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        if self.cross is not None:
            longest = self.cross_blocks * self.block_size
            decodes = AttentionMetadata(
                query_start_loc=self.query_start_loc[: b + 1],
                seq_lens=self.cross_seq_lens[:b],
                block_tables=self.cross_tables[:b],
                slot_mapping=self.slot_mapping[:0],
                query_start_loc_cpu=list(range(b + 1)),
                seq_lens_cpu=[longest] * b,
                max_query_len=1,
                max_seq_len=longest,
                block_size=self.block_size,
                num_decodes=b,
            )
            seqs = [CrossAttentionSeq(slice(i, i + 1), 0, 0, [], None, 0) for i in range(b)]
            meta.cross = CrossAttentionBatch(
                seqs, self.cross.caches, b, decodes, self.cross_backend
            )
        return meta

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.model.embed_input_ids(self.input_ids[:b])
        hidden = self.model(embeds, self.positions[..., :b], self._meta(b))
        return self.model.compute_logits(hidden), hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first so smaller ones reuse its memory pool."""
        for b in reversed(self.buckets):
            self._forward(b)  # warm up (Triton autotune/compile) outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, self.pool):
                self.logits[b], self.hidden[b] = self._forward(b)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)

    def run(
        self,
        input_ids: list[int],
        positions: torch.Tensor,
        slots: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
        cross: tuple[list[list[int]], list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest bucket that fits; returns (logits [n, V], final hidden states [n, H]) of the
        n = len(input_ids) rows (views, valid until the next replay).

        positions: [n] or [3, n] (M-RoPE) int64 on the host. fill: (rows, ids) device tensors that
        overwrite those rows' input ids on the device (tokens the host does not have yet). cross: each row's
        cross-attention pool blocks (at most cross_blocks) and the tokens of them it attends.
        """
        n = len(input_ids)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        st = self._staging[self._turn]
        self._turn ^= 1
        if st.copied is not None:
            st.copied.synchronize()
        ints = st.ints.numpy()
        ints[0, :n] = input_ids
        ints[0, n:b] = 0
        ints[1, :b] = -1
        ints[1, :n] = slots
        ints[2, :b] = 0
        ints[2, :n] = seq_lens
        pos = st.pos.numpy()
        pos[..., :b] = 0
        pos[..., :n] = positions.numpy()
        tables = st.tables.numpy()
        tables[:b] = 0
        for i, row in enumerate(block_tables):
            tables[i, : len(row)] = row
        self.input_ids[:b].copy_(st.ints[0, :b], non_blocking=True)
        self.slot_mapping[:b].copy_(st.ints[1, :b], non_blocking=True)
        self.seq_lens[:b].copy_(st.ints[2, :b], non_blocking=True)
        self.positions[..., :b].copy_(st.pos[..., :b], non_blocking=True)
        self.block_tables[:b].copy_(st.tables[:b], non_blocking=True)
        if cross is not None:
            ints[3, :b] = 0
            ints[3, :n] = cross[1]
            ctables = st.cross_tables.numpy()
            ctables[:b] = 0
            for i, row in enumerate(cross[0]):
                ctables[i, : len(row)] = row
            self.cross_seq_lens[:b].copy_(st.ints[3, :b], non_blocking=True)
            self.cross_tables[:b].copy_(st.cross_tables[:b], non_blocking=True)
        st.copied = torch.cuda.Event()
        st.copied.record()
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[b].replay()
        return self.logits[b][:n], self.hidden[b][:n]


class _Staging:
    """Pinned host buffers of one step's graph inputs."""

    def __init__(
        self, n: int, pos_shape: torch.Size, max_blocks_per_seq: int, cross_blocks: int
    ) -> None:
        self.ints = torch.zeros(
            4, n, dtype=torch.int64
        ).pin_memory()  # ids, slots, context lengths, cross lengths
        self.pos = torch.zeros(pos_shape, dtype=torch.int64).pin_memory()
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32).pin_memory()
        self.cross_tables = torch.zeros(n, cross_blocks, dtype=torch.int32).pin_memory()
        self.copied: torch.cuda.Event | None = None
