"""ModelRunner: turns a SchedulerOutput into batch tensors, runs vision encoders and the LM, samples.

Owns the model, the KV cache tensors and the encoder cache; knows nothing about HTTP or queues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import TYPE_CHECKING

import torch
from torch import nn

from mmserve.attention.kv_layout import new_kv_cache
from mmserve.config import CacheConfig
from mmserve.core.multimodal import MultiModalItem
from mmserve.core.step import RunnerOutput, SchedulerOutput
from mmserve.core.transfer import cdiv, to_device
from mmserve.kernels.fp8_format import is_fp8
from mmserve.layers.attention import Attention
from mmserve.lora import LoRAManager
from mmserve.multimodal.prompt_table import MODALITY as TABLE_MODALITY
from mmserve.worker.batch_inputs import attention_metadata
from mmserve.worker.cross_kv import CrossKVPool
from mmserve.worker.cuda_graph import DecodeGraphs
from mmserve.worker.encoder_cache import EncoderCache
from mmserve.worker.encoder_graphs import EncoderGraphs, vision_kernels
from mmserve.worker.launched_step import LaunchedStep
from mmserve.worker.memory_profile import (
    kv_pool_blocks,
    peak_activation_bytes,
    profile_prefill,
    scratch_kv_cache,
)
from mmserve.worker.piecewise_graphs import PiecewiseGraphs
from mmserve.worker.prefill_graphs import PrefillGraphs, token_buckets
from mmserve.worker.prompt_logprobs import chunk_logprobs
from mmserve.worker.request_inputs import (
    cross_attention_batch,
    cross_decode_inputs,
    lora_row_groups,
    lora_rows,
)
from mmserve.worker.sampler import Sampler, SamplingBatch
from mmserve.worker.step_batch import FlatBatch, flatten
from mmserve.worker.tp_mirror import lora_sync, run_mirrored

if TYPE_CHECKING:
    from mmserve.worker.tp_workers import TPWorkers


CROSS_ENCODE_BATCH = (
    8  # Llama 3.2 Vision: 8 pictures of 4 tiles are ~51k vision tokens, enough to fill an H100
)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        cache_config: CacheConfig,
        vocab_size: int,
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.uses_mrope = model.family.mrope  # positions [3, T] (Qwen2-VL)
        self.uses_cross_attention = model.family.cross_attention  # Mllama
        self.cross_kv_budget = 0  # bytes for the cross-attention pool (num_blocks_for)
        self.cross_kv: CrossKVPool | None = (
            None  # its requests' encoder keys/values (allocate_kv_cache)
        )
        # a cross-attention family's step may admit many requests with pictures at once (their prompts are short):
        # they are encoded this many at a time, the number the activation profile measures
        self.cross_encode_batch = CROSS_ENCODE_BATCH
        self.device = device
        self.dtype = dtype
        self.kv_dtype = cache_config.cache_dtype(dtype)
        self.block_size = cache_config.block_size
        self.vocab_size = vocab_size
        self.encoder_cache = EncoderCache(cache_config.encoder_cache_size)
        self.sampler = Sampler()
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.backend_name = self._select_backend(attention_backend)
        self._check_kv_dtype_supported()
        self.graphs: DecodeGraphs | None = None
        self.encoder_graphs: EncoderGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.prompt_ends: torch.Tensor | None = (
            None  # [slots, H] final hidden states of prompts (PromptEndCache)
        )
        self.lora: LoRAManager | None = (
            None  # the engine's adapters; steps with LoRA rows run eagerly
        )
        self.tp: TPWorkers | None = (
            None  # the driver's tensor-parallel workers: they mirror each forward
        )

    def _select_backend(self, name: str) -> str:
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        if name == "triton":
            from mmserve.attention import triton_backend

            for layer in self.attn_layers:
                layer.backend = triton_backend
        return name

    def _check_kv_dtype_supported(self) -> None:
        # Triton converts to/from e4m3 with the hardware instructions of Ada / Hopper and newer
        if is_fp8(self.kv_dtype) and self.device.type == "cuda" and self.backend_name == "triton":
            cap = torch.cuda.get_device_capability(self.device)
            if cap < (8, 9):
                raise ValueError(
                    f"kv_cache_dtype fp8 needs a GPU of compute capability >= 8.9 with the triton "
                    f"attention backend; {torch.cuda.get_device_name(self.device)} is {cap[0]}.{cap[1]}"
                )

    @torch.inference_mode()
    def warm_up_sampler(self) -> None:
        """Compile the sampler's kernels now (Sampler.warm_up), not on the first sampled step after startup."""
        if self.device.type == "cuda":
            token = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.sampler.warm_up(
                self.model.compute_logits(self.model.embed_input_ids(token)), self.vocab_size
            )

    def capture_cuda_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        cross_tokens: int | None = None,
    ) -> None:
        """Record decode-step graphs, whole-model graphs of small prefills and piecewise graphs of the other
        steps (CUDA + Triton backend only); call after allocate_kv_cache (and allocate_cross_kv). A cross-attention
        family gets decode graphs only, if it allows them (`cross_decode_graphs`), for decodes attending at most
        two pictures of `cross_tokens` encoder tokens (a blank picture's: the same number on every rank)."""
        if self.device.type != "cuda" or self.backend_name != "triton":
            return
        max_blocks = cdiv(max_model_len, self.block_size)
        mrope = self.uses_mrope
        if self.uses_cross_attention:
            if (
                not self.model.family.cross_decode_graphs
                or cross_tokens is None
                or self.cross_kv is None
            ):
                return
            self.graphs = DecodeGraphs(
                self.model,
                self.device,
                max_num_seqs,
                max_blocks,
                self.block_size,
                max_model_len,
                cross=self.cross_kv,
                cross_backend=self.attn_layers[0].backend,
                cross_blocks=2 * cdiv(cross_tokens, self.block_size),
            )
            self.graphs.capture()
            return
        self.graphs = DecodeGraphs(
            self.model,
            self.device,
            max_num_seqs,
            max_blocks,
            self.block_size,
            max_model_len,
            mrope=mrope,
        )
        self.graphs.capture()
        hidden_size = self._hidden_size()
        self.prefill_graphs = PrefillGraphs(
            self.model,
            self.device,
            self.dtype,
            hidden_size,
            max_num_batched_tokens,
            max_blocks,
            self.block_size,
            max_model_len,
            mrope,
            pool=self.graphs.pool,
        )
        self.prefill_graphs.capture()
        self.piecewise_graphs = PiecewiseGraphs(
            self.model,
            self.device,
            self.dtype,
            hidden_size,
            token_buckets(max_num_batched_tokens),
            mrope,
            pool=self.graphs.pool,
        )
        self.piecewise_graphs.capture()

    def release_cuda_graphs(self) -> None:
        """Drop every captured graph. Under tensor parallelism this must come before the process group is
        destroyed: NCCL will not tear down a communicator while a graph that captured its collectives exists."""
        if self.graphs is None and self.prefill_graphs is None and self.piecewise_graphs is None:
            return
        self.graphs = self.prefill_graphs = self.piecewise_graphs = self.encoder_graphs = None
        gc.collect()  # graph objects caught in reference cycles go now, not at some later collection
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def weight_bytes(self) -> int:
        """Bytes of this rank's model parameters and buffers."""
        return sum(
            t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers())
        )

    def _hidden_size(self) -> int:
        return self.model.embed_input_ids(
            torch.zeros(1, dtype=torch.int64, device=self.device)
        ).shape[-1]

    @torch.inference_mode()
    def allocate_prompt_ends(self, num_slots: int) -> None:
        """The device rows PromptEndCache hands out (before the KV cache is sized: they are not free for it)."""
        self.prompt_ends = torch.zeros(
            num_slots, self._hidden_size(), dtype=self.dtype, device=self.device
        )

    def capture_encoder_graphs(
        self, template: MultiModalItem | None, max_num_batched_tokens: int
    ) -> None:
        """Replay the vision encoder from CUDA graphs (families with `encoder_cuda_graphs`, CUDA only); with a
        template item, capture its shapes now for every batch a step can encode (a step of
        max_num_batched_tokens overlaps at most cdiv(tokens, item length) + 1 items), other shapes on first use."""
        if self.device.type != "cuda" or not self.model.family.encoder_cuda_graphs:
            return
        self.encoder_graphs = EncoderGraphs(self.model, self.device)
        if template is not None:
            with self._vision_kernels():  # a graph keeps the kernels chosen while it was captured
                self.encoder_graphs.warm_up(
                    self._on_device(template), cdiv(max_num_batched_tokens, template.length) + 1
                )

    def plan_kv_cache(
        self,
        cache_config: CacheConfig,
        num_tokens: int,
        template: MultiModalItem | None = None,
        cross_template: tuple[MultiModalItem, int] | None = None,
    ) -> int:
        """The KV pool's size in blocks after profiling a step of `num_tokens` (and `template`'s encoding)."""
        return self.num_blocks_for(
            cache_config, self.profile_peak_activation_bytes(num_tokens, template, cross_template)
        )

    def profile_peak_activation_bytes(
        self,
        num_tokens: int,
        template: MultiModalItem | None = None,
        cross_template: tuple[MultiModalItem, int] | None = None,
    ) -> int:
        """The memory a step needs beyond weights and KV cache, measured on CUDA (0 elsewhere): see
        :func:`mmserve.worker.memory_profile.peak_activation_bytes`."""
        return peak_activation_bytes(self, num_tokens, template, cross_template)

    def profile_prefill(
        self,
        num_tokens: int,
        template: MultiModalItem | None = None,
        cross_template: tuple[MultiModalItem, int] | None = None,
    ) -> None:
        """The profile's forward pass alone, on any device, through a scratch KV cache (this runner's own stays):
        on the CPU, where no memory is profiled, it shows that every tensor-parallel rank's profile runs the same
        collectives (tests)."""
        with scratch_kv_cache(self, num_tokens):
            profile_prefill(self, num_tokens, template, cross_template)

    # ---- KV cache --------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        per_layer = (
            2 * self.block_size * a.num_kv_heads * a.head_dim * torch.finfo(self.kv_dtype).bits // 8
        )
        return per_layer * len(self.attn_layers)

    def num_blocks_for(self, cache_config: CacheConfig, activation_peak: int = 0) -> int:
        """The KV pool's size in blocks (memory_profile.kv_pool_blocks); sets `cross_kv_budget`."""
        return kv_pool_blocks(self, cache_config, activation_peak)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.attn_layers:
            cache = new_kv_cache(
                num_blocks,
                self.block_size,
                layer.num_kv_heads,
                layer.head_dim,
                self.kv_dtype,
                self.device,
            )
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    def cross_kv_num_blocks(self) -> int:
        """Blocks of the cross-attention pool that `cross_kv_budget` (set by plan_kv_cache) pays for."""
        if not self.uses_cross_attention:
            return 0
        return CrossKVPool.blocks_for(
            self.model.cross_kv_layout(), self.dtype, self.cross_kv_budget, self.block_size
        )

    def allocate_cross_kv(self, num_blocks: int) -> None:
        """The cross-attention pool of a cross-attention family, num_blocks large (cross_kv_num_blocks, the
        smallest over the tensor-parallel ranks: a request's blocks have the same ids on every rank)."""
        if not self.uses_cross_attention:
            return
        self.cross_kv = None  # the old pool's memory goes back before the new one is taken
        self.cross_kv = CrossKVPool(
            self.model.cross_kv_layout(), self.dtype, num_blocks, self.block_size, self.device
        )

    # ---- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step's work on the device and return without waiting for it.

        A request whose last input token is still PLACEHOLDER (sampled by `prev`, not yet on the host)
        gets it on the device, from `prev.tokens[request.last_sample_row]`. Requests with nothing to compute
        (prompt-end loads, last in the batch) sample from their kept final hidden states.
        """
        computed = sched.computed
        loads = sched.scheduled[len(computed) :]
        loaded = (
            None  # gathered before this step's stores: a slot may be claimed again by one of them
        )
        if loads:
            loaded = self.prompt_ends[
                to_device([s.load_prompt_end for s in loads], torch.int64, self.device)
            ]
        if not computed:
            return self._sample([s.request for s in loads], self.model.compute_logits(loaded))
        batch = flatten(computed, prev, self.block_size, self.device, self.uses_mrope)
        rows_by_adapter = (
            lora_rows(computed, batch.qsl) if self.lora is not None and self.lora.adapters else {}
        )
        graphs_ok = not rows_by_adapter
        cross = None
        if (
            graphs_ok
            and self.graphs is not None
            and self.graphs.cross is not None
            and batch.one_token_each
        ):
            cross = cross_decode_inputs(computed, self.graphs.cross_blocks, self.block_size)
            graphs_ok = cross is not None
        if (
            graphs_ok
            and self.graphs is not None
            and batch.one_token_each
            and len(computed) <= self.graphs.max_batch
        ):
            # 1-token prompt chunks ride here too and sample nothing
            return self._finish(batch, *self._run_decode_graph(batch, cross), loads, loaded)
        return self._finish(
            batch, None, self._run_forward(batch, rows_by_adapter, graphs_ok), loads, loaded
        )

    def _run_decode_graph(self, batch: FlatBatch, cross) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the decode graph on `batch` (one token per sequence): (logits, final hidden states), a row
        each, views of the graph's buffers valid until its next replay."""
        if (
            self.tp is not None
        ):  # a cross-attention family's decodes also send their pool blocks and lengths
            self.tp.forward(
                "decode",
                (
                    batch.input_ids,
                    batch.positions,
                    batch.slots,
                    batch.seq_lens,
                    batch.block_tables,
                    cross,
                ),
                list(batch.fill) if batch.fill is not None else [],
            )
        return self.graphs.run(
            batch.input_ids,
            batch.positions,
            batch.slots,
            batch.seq_lens,
            batch.block_tables,
            batch.fill,
            cross,
        )

    def _run_forward(
        self, batch: FlatBatch, rows_by_adapter: dict[str, list[int]], graphs_ok: bool
    ) -> torch.Tensor:
        """The model over every token of `batch` (prefill graphs, piecewise graphs or eager, which applies the LoRA
        adapters of `rows_by_adapter`): final hidden states."""
        dev, computed, qsl, slots = self.device, batch.seqs, batch.qsl, batch.slots
        ids = to_device(batch.input_ids, torch.int64, dev)
        if batch.fill is not None:
            ids[batch.fill[0]] = batch.fill[1]
        embeds = self.model.embed_input_ids(ids)
        if not self.uses_cross_attention:
            self._merge_mm_embeddings(computed, qsl, embeds)
        n = len(batch.input_ids)
        if (
            graphs_ok
            and self.prefill_graphs is not None
            and self.prefill_graphs.fits(len(computed), n)
        ):
            kind = "prefill"
        elif graphs_ok and self.piecewise_graphs is not None and self.piecewise_graphs.fits(n):
            kind = "piecewise"
        else:
            kind = "eager"
        meta, cross_host, written = None, None, []
        if kind == "eager":
            meta = attention_metadata(computed, slots, qsl, batch.seq_lens, self.block_size, dev)
            if (
                self.uses_cross_attention
            ):  # encodes and writes new requests' pictures: before the workers start
                meta.cross, cross_host, written = cross_attention_batch(
                    computed,
                    qsl,
                    self._encode,
                    self.model,
                    self.cross_kv,
                    self.attn_layers[0].backend,
                    self.cross_encode_batch,
                    mirror=self.tp is not None,
                )
        if self.tp is not None:
            self.tp.forward(
                kind,
                (
                    batch.positions,
                    slots,
                    qsl,
                    batch.seq_lens,
                    batch.block_tables,
                    rows_by_adapter,
                    None if cross_host is None else cross_host.for_workers(self.model),
                ),
                [embeds, *written],
            )
        if kind == "prefill":
            return self.prefill_graphs.run(
                embeds, batch.positions, slots, qsl, batch.seq_lens, batch.block_tables
            )
        if kind == "piecewise":
            # the graphs write the cache through their own slot buffer (filled by run): no copy of the slots here
            meta = attention_metadata(
                computed,
                slots,
                qsl,
                batch.seq_lens,
                self.block_size,
                dev,
                self.piecewise_graphs.inputs.slot_mapping[: len(slots)],
            )
            return self.piecewise_graphs.run(embeds, batch.positions, slots, meta)
        return self.run_eager(
            embeds, to_device(batch.positions, torch.int64, dev), meta, rows_by_adapter
        )

    def run_eager(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta,
        rows_by_adapter: dict[str, list[int]],
    ) -> torch.Tensor:
        """The model without graphs, with the LoRA adapters of `rows_by_adapter` on their rows."""
        lora = lora_row_groups(rows_by_adapter, self.lora, self.device) if rows_by_adapter else []
        with self.lora.step(lora) if lora else contextlib.nullcontext():
            return self.model(embeds, positions, meta)

    def lora_sync(self, removed: list[str], name: str, source, evictable: bool) -> None:
        """A tensor-parallel worker's copy of the driver's adapter change (tp_mirror.lora_sync)."""
        lora_sync(self, removed, name, source, evictable)

    def run_mirrored(self, kind: str, host: tuple, specs: list) -> None:
        """A tensor-parallel worker's side of a driver's forward (worker/tp_workers.py): the same graph or eager
        pass over inputs received from rank 0; the hidden states are the driver's business."""
        run_mirrored(self, kind, host, specs)

    def _finish(
        self,
        batch: FlatBatch,
        logits: torch.Tensor | None,
        hidden: torch.Tensor,
        loads: list,
        loaded: torch.Tensor | None,
    ) -> LaunchedStep:
        """Sample the step from its logits (a row per token; None: from the hidden state of each sampling
        sequence's last token); prompt-end loads sample last, from `loaded`."""
        self._store_prompt_ends(batch.seqs, hidden, batch.qsl)
        reqs = [batch.seqs[i].request for i in batch.sampling] + [s.request for s in loads]
        chunks = []
        if batch.sampling and logits is None:
            rows = to_device(
                [batch.qsl[i + 1] - 1 for i in batch.sampling], torch.int64, self.device
            )
            chunks.append(self.model.compute_logits(hidden[rows]))
        elif batch.sampling:
            contiguous = batch.sampling == list(range(len(batch.sampling)))
            chunks.append(
                logits[: len(batch.sampling)]
                if contiguous
                else logits[to_device(batch.sampling, torch.int64, self.device)]
            )
        if loaded is not None:
            chunks.append(self.model.compute_logits(loaded))
        step = self._sample(
            reqs, torch.cat(chunks) if len(chunks) > 1 else chunks[0] if chunks else None
        )
        self._context_logits(batch.seqs, batch.qsl, step.out, hidden=hidden, logits=logits)
        return step

    def _store_prompt_ends(self, computed: list, hidden: torch.Tensor, qsl: list[int]) -> None:
        """Keep the final hidden state of each prompt this step completes in its prompt-end slot (request i's
        rows of `hidden` end at qsl[i + 1])."""
        stores = [
            (i, s.store_prompt_end)
            for i, s in enumerate(computed)
            if s.store_prompt_end is not None
        ]
        if not stores:
            return
        rows = [qsl[i + 1] - 1 for i, _ in stores]
        dev = self.device
        self.prompt_ends[to_device([slot for _, slot in stores], torch.int64, dev)] = hidden[
            to_device(rows, torch.int64, dev)
        ].to(self.prompt_ends.dtype)

    def _context_logits(
        self,
        computed: list,
        qsl: list[int],
        out: RunnerOutput,
        hidden: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Logits of this step's prompt positions for requests with return_context_logits, and the prompt tokens'
        logprobs for those with prompt_logprobs (from the hidden states, or from the step's logits when every row
        already has them)."""
        for i, s in enumerate(computed):
            req = s.request
            end = min(s.end, req.num_prompt_tokens)
            if not req.params.needs_prompt_logits or s.start >= end:
                continue
            rows = slice(qsl[i], qsl[i] + end - s.start)
            chunk = logits[rows] if logits is not None else self.model.compute_logits(hidden[rows])
            if req.params.return_context_logits:
                out.context_logits[req.request_id] = (s.start, chunk.float().cpu())
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs[req.request_id] = chunk_logprobs(
                    chunk, req.prompt_token_ids, s.start, req.params.prompt_logprobs
                )

    def _sample(self, reqs: list, logits: torch.Tensor | None) -> LaunchedStep:
        """logits [B, V] of the requests that sample this step -> their new tokens (queued)."""
        if not reqs:
            return LaunchedStep([], None, RunnerOutput())
        batch = SamplingBatch.build(
            [r.params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.generator for r in reqs],
            [r.eos_token_ids for r in reqs],
            [r.bad_words for r in reqs],
            logits.shape[-1],
            self.device,
            grammars=[r.grammar for r in reqs],
        )
        out = RunnerOutput()
        for i, r in enumerate(reqs):
            if r.params.return_generation_logits:
                out.generation_logits[r.request_id] = logits[i].float().cpu()
        return LaunchedStep(reqs, self.sampler(logits, batch), out)

    def _merge_mm_embeddings(self, computed: list, qsl: list[int], embeds: torch.Tensor) -> None:
        """Overwrite placeholder-token embeddings with the vision encoder's outputs for this chunk."""
        spans = []  # (flat dst, item, src offset in item, count)
        for i, s in enumerate(computed):
            for item in s.request.mm_items_in(s.start, s.end):
                lo, hi = max(s.start, item.offset), min(s.end, item.end)
                spans.append((qsl[i] + lo - s.start, item, lo - item.offset, hi - lo))
        if not spans:
            return
        encoded = self._encode([item for _, item, _, _ in spans])
        for dst, item, src, n in spans:
            embeds[dst : dst + n] = encoded[item.content_hash][src : src + n].to(embeds.dtype)

    def _encode(self, items: list[MultiModalItem]) -> dict[str, torch.Tensor]:
        """Embeddings by content hash: cached ones reused, the rest encoded in batches of equal shape."""
        out: dict[str, torch.Tensor] = {}
        todo: dict[tuple, list[MultiModalItem]] = {}
        for item in items:
            if item.content_hash in out:
                continue
            if (
                item.modality == TABLE_MODALITY
            ):  # a client's prompt table: the embeddings themselves, no encoder
                out[item.content_hash] = self._on_device(item).data["embeddings"]
                continue
            emb = self.encoder_cache.get(item.content_hash)
            if emb is not None:
                out[item.content_hash] = emb
                continue
            out[item.content_hash] = None
            key = (item.modality,) + tuple(
                (k, tuple(v.shape)) for k, v in sorted(item.data.items())
            )
            todo.setdefault(key, []).append(item)
        for group in todo.values():
            moved = [self._on_device(it) for it in group]
            with self._vision_kernels():
                if self.encoder_graphs is not None:
                    embeddings = self.encoder_graphs.encode(moved)
                else:
                    embeddings = self.model.get_mm_embeddings(moved)
            for item, emb in zip(group, embeddings):
                out[item.content_hash] = emb
                self.encoder_cache.put(item.content_hash, emb)
        return out

    def _vision_kernels(self) -> contextlib.AbstractContextManager:
        """encoder_graphs.vision_kernels for this model's dtype."""
        return vision_kernels(self.dtype)

    def _on_device(self, item: MultiModalItem) -> MultiModalItem:
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
                )  # pinned: a pageable copy would sync the stream
            else:
                data[k] = v.to(self.device, self.dtype)
        return dataclasses.replace(item, data=data)
