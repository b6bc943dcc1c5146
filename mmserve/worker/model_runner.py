"""ModelRunner: turns a SchedulerOutput into batch tensors and runs the language model on them, through the
decode / prefill / piecewise CUDA graphs or eagerly; its encoder (`encoder_runner.py`) and the step's sampling
(`step_sampling.py`) are rooms of their own. Owns the model and the KV pools; knows nothing of HTTP or queues.
"""

from __future__ import annotations

import contextlib
import gc
from typing import TYPE_CHECKING

import torch
from torch import nn

from mmserve.attention.backend_choice import select_backend
from mmserve.attention.kv_layout import new_kv_cache
from mmserve.config import CacheConfig
from mmserve.core.multimodal import MultiModalItem
from mmserve.core.step import SchedulerOutput
from mmserve.core.transfer import to_device
from mmserve.layers.attention import Attention
from mmserve.lora import LoRAManager
from mmserve.worker.cross_kv import CrossKVPool
from mmserve.worker.cuda_graph import DecodeGraphs
from mmserve.worker.encoder_runner import EncoderRunner
from mmserve.worker.launched_step import LaunchedStep
from mmserve.worker.memory_profile import (
    kv_pool_blocks,
    peak_activation_bytes,
    profile_prefill,
    scratch_kv_cache,
)
from mmserve.worker.piecewise_graphs import PiecewiseGraphs
from mmserve.worker.prefill_graphs import PrefillGraphs
from mmserve.worker.request_inputs import (
    cross_attention_batch,
    cross_decode_inputs,
    lora_row_groups,
    lora_rows,
    media_lora_rows,
    media_rows,
)
from mmserve.worker.step_batch import FlatBatch, flatten
from mmserve.worker.step_execution import StepInputs, execute_step
from mmserve.worker.step_graphs import StepGraphShape, capture_step_graphs
from mmserve.worker.step_sampling import StepSampling
from mmserve.worker.tp_mirror import lora_sync, receive_step_tensors

if TYPE_CHECKING:
    from mmserve.worker.tp_workers import TPWorkers


# Llama 3.2 Vision: 8 pictures of 4 tiles are ~51k vision tokens, enough to fill an H100
CROSS_ENCODE_BATCH = 8


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
        self.cross_kv_budget = 0  # bytes for the cross-attention pool (num_blocks_for)
        self.cross_kv: CrossKVPool | None = (
            None  # requests' encoder keys/values (allocate_cross_kv)
        )
        # a cross-attention family's step may admit many requests with pictures at once (their prompts are short):
        # they are encoded this many at a time, the number the activation profile measures
        self.cross_encode_batch = CROSS_ENCODE_BATCH
        self.device = device
        self.dtype = dtype
        self.kv_dtype = cache_config.cache_dtype(dtype)
        self.block_size = cache_config.block_size
        self.vocab_size = vocab_size
        self.encoder = EncoderRunner(model, device, dtype, cache_config.encoder_cache_size)
        self.sampling = StepSampling(model, device)
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_caches: list[torch.Tensor] = []
        self.backend_name = select_backend(
            attention_backend, device, self.attn_layers, self.kv_dtype
        )
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.lora: LoRAManager | None = (
            None  # the engine's adapters; steps with LoRA rows run eagerly
        )
        self.tp: TPWorkers | None = None  # the driver's tensor-parallel workers mirror each forward

    @torch.inference_mode()
    def warm_up_sampler(self) -> None:
        """Compile the sampler's kernels now (Sampler.warm_up), not on the first sampled step after startup."""
        if self.device.type == "cuda":
            token = torch.zeros(1, dtype=torch.int64, device=self.device)
            self.sampling.sampler.warm_up(
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
        self.graphs, self.prefill_graphs, self.piecewise_graphs = capture_step_graphs(
            self.model,
            self.device,
            self.dtype,
            self.cross_kv,
            self.attn_layers[0].backend,
            self._hidden_size(),
            StepGraphShape(
                max_num_seqs, max_model_len, max_num_batched_tokens, self.block_size, cross_tokens
            ),
        )

    def capture_encoder_graphs(self, template: MultiModalItem | None, max_tokens: int) -> None:
        """EncoderRunner.capture_graphs (every rank's, with --mm-encoder-tp-mode data)."""
        self.encoder.capture_graphs(template, max_tokens)

    def items_encoded(self) -> int:
        """Pictures and videos this rank's vision tower has encoded (EncoderRunner.items_encoded)."""
        return self.encoder.items_encoded

    def release_cuda_graphs(self) -> None:
        """Drop every captured graph. Under tensor parallelism this must come before the process group is
        destroyed: NCCL will not tear down a communicator while a graph that captured its collectives exists."""
        if self.graphs is None and self.prefill_graphs is None and self.piecewise_graphs is None:
            return
        self.graphs = self.prefill_graphs = self.piecewise_graphs = self.encoder.graphs = None
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
        self.sampling.prompt_ends = torch.zeros(
            num_slots, self._hidden_size(), dtype=self.dtype, device=self.device
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
        self.kv_caches = [
            new_kv_cache(
                num_blocks, self.block_size, a.num_kv_heads, a.head_dim, self.kv_dtype, self.device
            )
            for a in self.attn_layers
        ]
        for layer, cache in zip(self.attn_layers, self.kv_caches):
            layer.kv_cache = cache

    def cross_kv_num_blocks(self) -> int:
        """Blocks of the cross-attention pool that `cross_kv_budget` (set by plan_kv_cache) pays for."""
        if not self.model.family.cross_attention:
            return 0
        return CrossKVPool.blocks_for(
            self.model.cross_kv_layout(), self.dtype, self.cross_kv_budget, self.block_size
        )

    def allocate_cross_kv(self, num_blocks: int) -> None:
        """The cross-attention pool of a cross-attention family, num_blocks large (cross_kv_num_blocks, the
        smallest over the tensor-parallel ranks: a request's blocks have the same ids on every rank)."""
        if not self.model.family.cross_attention:
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
            loaded = self.sampling.prompt_ends[
                to_device([s.load_prompt_end for s in loads], torch.int64, self.device)
            ]
        if not computed:
            return self.sampling.sample(
                [s.request for s in loads], self.model.compute_logits(loaded)
            )
        family = self.model.family
        batch = flatten(
            computed, prev, self.block_size, self.device, family.mrope, sched.block_table
        )
        rule = family.media_rows
        media = media_rows(computed, batch.qsl, rule) if rule is not None else []
        if family.media_lora:
            builtin = self.model.builtin_lora
            names = builtin.name if builtin is not None else None
            rows_by_adapter = media_lora_rows(computed, batch.qsl, rule, names) if media else {}
        else:
            rows_by_adapter = (
                lora_rows(computed, batch.qsl)
                if self.lora is not None and self.lora.adapters
                else {}
            )
        graphs_ok = (
            not rows_by_adapter and not media
        )  # graphs bake no rows in: these steps run eagerly
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
            return self.sampling.finish(batch, *self._run_decode_graph(batch, cross), loads, loaded)
        hidden = self._run_forward(batch, rows_by_adapter, graphs_ok, media)
        return self.sampling.finish(batch, None, hidden, loads, loaded)

    def _run_decode_graph(self, batch: FlatBatch, cross) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the decode graph on `batch` (one token per sequence): (logits, final hidden states), a row
        each, views of the graph's buffers valid until its next replay."""
        inputs = StepInputs(
            "decode",
            batch.positions,
            batch.slots,
            batch.qsl,
            batch.seq_lens,
            batch.block_tables,
            input_ids=batch.input_ids,
            cross=cross,  # a cross-attention family's decodes: their pool blocks and lengths
        )
        return self._execute(inputs, list(batch.fill) if batch.fill is not None else [])

    def _run_forward(
        self,
        batch: FlatBatch,
        rows_by_adapter: dict[str, list[int]],
        graphs_ok: bool,
        media: list[int],
    ) -> torch.Tensor:
        """The model over every token of `batch` (prefill graphs, piecewise graphs or eager, which applies the LoRA
        adapters of `rows_by_adapter` and gives the model the picture rows `media`): final hidden states."""
        computed, qsl = batch.seqs, batch.qsl
        ids = to_device(batch.input_ids, torch.int64, self.device)
        if batch.fill is not None:
            ids[batch.fill[0]] = batch.fill[1]
        embeds = self.model.embed_input_ids(ids)
        if not self.model.family.cross_attention:
            # only prompt chunks hold pictures (merge reads sequence i's first row, qsl[i])
            chunks = batch.prompt_chunks
            self.encoder.merge([computed[i] for i in chunks], [qsl[i] for i in chunks], embeds)
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
        inputs = StepInputs(
            kind,
            batch.positions,
            batch.slots,
            qsl,
            batch.seq_lens,
            batch.block_tables,
            rows_by_adapter=rows_by_adapter,
            media_rows=media,
            padded_tables=batch.padded_tables,
        )
        cross_meta, written = None, []
        if kind == "eager" and self.model.family.cross_attention:
            # encodes and writes new requests' pictures: before the workers start
            cross_meta, cross_host, written = cross_attention_batch(
                computed,
                qsl,
                self.encoder.encode,
                self.model,
                self.cross_kv,
                self.attn_layers[0].backend,
                self.cross_encode_batch,
                mirror=self.tp is not None,
            )
            if cross_host is not None and self.tp is not None:
                inputs.cross = cross_host.for_workers(self.model)
        return self._execute(inputs, [embeds, *written], cross_meta)[1]

    def _execute(
        self, inputs: StepInputs, tensors: list[torch.Tensor], cross_meta=None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run the pass here and, under tensor parallelism, on every worker (the same `execute_step`)."""
        if self.tp is not None:
            self.tp.forward(inputs, tensors)
        return execute_step(self, inputs, tensors, cross_meta)

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

    def run_mirrored(self, inputs: StepInputs) -> None:
        """A tensor-parallel worker's side of a driver's forward (worker/tp_workers.py): the pass's tensors by
        broadcast from rank 0, then the same `execute_step`; the outputs are the driver's business."""
        execute_step(self, inputs, receive_step_tensors(inputs, self.device))
