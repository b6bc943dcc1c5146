"""PiecewiseGraphs: the language model as CUDA graphs between its attention calls, per token bucket.

Steps the whole-model graphs cannot take — more than a few sequences with prompt chunks among them,
such as decodes mixed with new prompts, the steady state of an offline run — would launch every
kernel from Python: ~20 per layer, about 50 ms of host time for a 2048-token LLaVA-7B step that keeps
the GPU busy for ~45 ms. Here everything but attention (norms, projections, rotary, cache writes,
MLP) replays from graphs captured per token count, and each layer's attention runs eagerly between
two graphs over the step's own metadata, so any mix of decodes and prompt chunks fits a bucket.

Capture runs the model once per bucket with the attention layers' backend swapped for a splitter:
at each attention call it has the queries in a persistent buffer (the fused rotary kernel writes them
there; otherwise they are copied in), ends the current graph,
and begins the next one, whose first op reads the attention output buffer. Padding rows (past the
step's tokens) have slot -1 (no cache write) and keep whatever their attention output held; every
op inside the graphs is row-wise, so they never reach real rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.kernels.graph_capture import gc_paused
from mmserve.layers.attention import Attention
from mmserve.worker.prefill_graphs import TokenInputs


@dataclass
class _AttentionSite:
    """One attention call between two graphs: its queries and output live in persistent buffers."""

    layer: Attention
    q: torch.Tensor  # [t, H, D] view of a buffer the previous graph writes
    out: torch.Tensor  # [t, H, D] view of a buffer the next graph reads


class _Splitter:
    """Stands in for the attention backend while a bucket is captured (see the module docstring)."""

    def __init__(self, backend, buffers: dict, layers: list[Attention], pool) -> None:
        self.backend = backend
        self.buffers = (
            buffers  # (heads, head_dim, dtype) -> (q buffer, out buffer), [max_tokens, H, D]
        )
        self.layer_of_cache = {layer.kv_cache.data_ptr(): layer for layer in layers}
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.sites: list[_AttentionSite] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        graph, self._graph = self._graph, None
        graph.capture_end()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs.append(graph)

    def abandon(self) -> None:
        """End a capture left open by an exception in the model: an open capture would fail every later
        CUDA call on its stream (and a graph is never replayed from a failed capture)."""
        graph, self._graph = self._graph, None
        if graph is not None:
            try:
                graph.capture_end()
            except (
                RuntimeError
            ):  # the capture was invalidated by the error: ending it is all that matters
                pass

    def write_kv(self, *args) -> None:
        self.backend.write_kv(*args)

    def write_kv_rotary(
        self, positions: torch.Tensor, q: torch.Tensor, *args, **kwargs
    ) -> torch.Tensor:
        # the rotated queries go straight into the persistent buffer: paged_attention below then copies nothing
        # (a strided copy of a 2048-token step's queries took ~24 us per layer on an H100)
        t, heads, head_dim = q.shape
        return self.backend.write_kv_rotary(
            positions, q, *args, **kwargs, q_out=self.buffers[(heads, head_dim, q.dtype)][0][:t]
        )

    def paged_attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t, heads, head_dim = q.shape
        q_buf, out_buf = self.buffers[(heads, head_dim, q.dtype)]
        if q.data_ptr() != q_buf.data_ptr() or q.stride() != q_buf.stride():
            q_buf[:t].copy_(q)
        self.end()
        self.sites.append(
            _AttentionSite(self.layer_of_cache[kv_cache.data_ptr()], q_buf[:t], out_buf[:t])
        )
        self.begin()
        return out_buf[:t]


class PiecewiseGraphs:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        hidden_size: int,
        token_buckets: list[int],
        mrope: bool = False,
        pool=None,
    ) -> None:
        self.model = model
        self.device = device
        self.token_buckets = sorted(token_buckets)
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        t = self.token_buckets[-1]
        self.inputs = TokenInputs(t, hidden_size, dtype, device, mrope)
        self.buffers = {}
        for layer in self.layers:
            key = (layer.num_heads, layer.head_dim, dtype)
            if key not in self.buffers:
                self.buffers[key] = tuple(
                    torch.zeros(t, layer.num_heads, layer.head_dim, dtype=dtype, device=device)
                    for _ in range(2)
                )
        self.pieces: dict[
            int, tuple[list[torch.cuda.CUDAGraph], list[_AttentionSite], torch.Tensor]
        ] = {}
        self.pool = pool

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.token_buckets[-1]

    def _capture_meta(self, t: int) -> AttentionMetadata:
        """One sequence with no queries: attention has nothing to do, cache writes are all skipped."""
        zeros = torch.zeros(2, dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            query_start_loc=zeros,
            seq_lens=zeros[:1],
            block_tables=zeros[:1, None],
            slot_mapping=self.inputs.slot_mapping[:t],
            query_start_loc_cpu=[0, 0],
            seq_lens_cpu=[0],
            max_query_len=t,
            max_seq_len=0,
            block_size=1,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Graphs for every bucket, largest first so the rest reuse its memory pool. The KV cache must exist."""
        backend = self.layers[0].backend
        stream = torch.cuda.Stream(self.device)
        for t in reversed(self.token_buckets):
            meta = self._capture_meta(t)
            self.model(
                self.inputs.embeds[:t], self.inputs.positions[..., :t], meta
            )  # warm up outside capture
            torch.cuda.synchronize(self.device)
            splitter = _Splitter(backend, self.buffers, self.layers, self.pool)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                for layer in self.layers:
                    layer.backend = splitter
                with gc_paused(), torch.cuda.stream(stream):
                    splitter.begin()
                    try:
                        hidden = self.model(
                            self.inputs.embeds[:t], self.inputs.positions[..., :t], meta
                        )
                    except BaseException:
                        splitter.abandon()
                        raise
                    splitter.end()
            finally:
                for layer in self.layers:
                    layer.backend = backend
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.pool = splitter.pool
            self.pieces[t] = (splitter.graphs, splitter.sites, hidden)
        torch.cuda.synchronize(self.device)

    def run(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        slots: list[int],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of the step's n tokens (a view, valid until the next replay).

        embeds [n, hidden] on the device; positions [n] or [3, n] int64 on the host; meta: the step's
        attention metadata (only attention reads it)."""
        n = embeds.shape[0]
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, n)]
        self.inputs.fill(t, embeds, positions, slots)
        graphs, sites, hidden = self.pieces[t]
        for graph, site in zip(graphs, sites):
            graph.replay()
            layer = site.layer
            layer.backend.paged_attention(
                site.q[:n],
                layer.kv_cache,
                meta,
                layer.scale,
                layer.k_scale,
                layer.v_scale,
                out=site.out[:n],
            )
        graphs[-1].replay()
        return hidden[:n]
