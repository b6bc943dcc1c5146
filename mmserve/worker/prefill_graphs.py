"""PrefillGraphs: CUDA graphs of the language model over a few sequences' prompt chunks.

An eager forward launches ~10 kernels per layer and its host side (PyTorch dispatch, Triton launchers)
costs more than the GPU work of a short chunk: a one-image LLaVA-7B prompt or a prefix-cache hit was
host-bound. Steps with at most `max(SEQ_BUCKETS)` sequences and at most 2048 tokens replay a graph
captured for (sequences, tokens) buckets instead; larger steps keep enough GPU work to hide their launches. The graph starts from input embeddings (images
are merged eagerly, before it) and returns hidden states; logits are taken eagerly from the rows that
sample. Padding: token rows past the real ones have slot -1 (no cache write) and belong to no
sequence; padding sequences have no queries and context 0, so the varlen attention kernel skips them.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.core.transfer import copy_into
from mmserve.kernels.graph_capture import graph_capture

SEQ_BUCKETS = (1, 4)
# ~15-30 % apart: a chunk is padded to the next bucket, and padding rows cost full GEMM work; buckets above the
# step budget (--max-num-batched-tokens, 2048 by default) are never captured
TOKEN_BUCKETS = (
    16,
    32,
    64,
    96,
    128,
    192,
    256,
    320,
    384,
    512,
    640,
    768,
    896,
    1024,
    1280,
    1536,
    1792,
    2048,
    2560,
    3072,
    3584,
    4096,
    6144,
    8192,
)


def token_buckets(max_tokens: int) -> list[int]:
    """TOKEN_BUCKETS up to max_tokens (capped at the largest), which is a bucket itself."""
    cap = min(max_tokens, TOKEN_BUCKETS[-1])
    return [t for t in TOKEN_BUCKETS if t < cap] + [cap]


class TokenInputs:
    """Persistent per-token graph inputs (embeddings, positions, cache slots) of up to max_tokens rows."""

    def __init__(
        self,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        mrope: bool,
    ) -> None:
        self.embeds = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(
            (3, max_tokens) if mrope else (max_tokens,), dtype=torch.int64, device=device
        )
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)

    def fill(self, t: int, embeds: torch.Tensor, positions: torch.Tensor, slots: list[int]) -> None:
        """The first n = len(embeds) rows of a t-row bucket; rows n..t get position 0 and slot -1 (no write).

        embeds [n, hidden] on the device; positions [n] or [3, n] int64 on the host."""
        n = embeds.shape[0]
        self.embeds[:n].copy_(embeds)
        pos = torch.zeros(positions.shape[:-1] + (t,), dtype=torch.int64)
        pos[..., :n] = positions
        copy_into(self.positions[..., :t], pos)
        copy_into(self.slot_mapping[:t], slots + [-1] * (t - n))


class PrefillGraphs:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        hidden_size: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        mrope: bool = False,
        pool=None,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.token_buckets = token_buckets(max_tokens)
        s, t = SEQ_BUCKETS[-1], self.token_buckets[-1]
        self.inputs = TokenInputs(t, hidden_size, dtype, device, mrope)
        self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(s, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = pool

    def fits(self, num_seqs: int, num_tokens: int) -> bool:
        return num_seqs <= SEQ_BUCKETS[-1] and num_tokens <= self.token_buckets[-1]

    def _meta(self, s: int, t: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: s + 1],
            seq_lens=self.seq_lens[:s],
            block_tables=self.block_tables[:s],
            slot_mapping=self.inputs.slot_mapping[:t],
            query_start_loc_cpu=[0] * (s + 1),
            seq_lens_cpu=[self.max_model_len] * s,
            max_query_len=t,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per (sequences, tokens) bucket, largest first so the rest reuse its memory pool.

        The KV cache must exist; capture runs with every slot -1 and no queries, so it writes nothing."""
        for t in reversed(self.token_buckets):
            for s in reversed(SEQ_BUCKETS):
                self.model(
                    self.inputs.embeds[:t], self.inputs.positions[..., :t], self._meta(s, t)
                )  # warm up
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with graph_capture(graph, self.pool):
                    self.hidden[(s, t)] = self.model(
                        self.inputs.embeds[:t], self.inputs.positions[..., :t], self._meta(s, t)
                    )
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(s, t)] = graph
        torch.cuda.synchronize(self.device)

    def run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        slots: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of the step's n tokens (a view, valid until the next replay).

        embeds [n, hidden] on the device; positions [n] or [3, n] int64 on the host."""
        n, num_seqs = embeds.shape[0], len(seq_lens)
        s = SEQ_BUCKETS[bisect.bisect_left(SEQ_BUCKETS, num_seqs)]
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, n)]
        self.inputs.fill(t, embeds, positions, slots)
        copy_into(self.query_start_loc[: s + 1], query_start_loc + [n] * (s - num_seqs))
        copy_into(self.seq_lens[:s], seq_lens + [0] * (s - num_seqs))
        width = self.block_tables.shape[1]
        copy_into(
            self.block_tables[:s],
            [row + [0] * (width - len(row)) for row in block_tables]
            + [[0] * width] * (s - num_seqs),
        )
        self.graphs[(s, t)].replay()
        return self.hidden[(s, t)][:n]
