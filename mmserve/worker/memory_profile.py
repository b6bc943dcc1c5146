"""The activation memory profile that sizes the KV cache: one step's peak beyond weights and KV cache, measured
on the GPU with a text prefill of the step budget (and the vision encoder's, for models whose encoder runs eagerly),
and the pool size that leaves (`kv_pool_blocks`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from mmserve.attention.metadata import AttentionMetadata, CrossAttentionBatch, CrossAttentionSeq
from mmserve.config import CacheConfig
from mmserve.core.multimodal import MultiModalItem
from mmserve.core.transfer import cdiv
from mmserve.worker.cross_kv import CrossKVPool

if TYPE_CHECKING:
    from mmserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@torch.inference_mode()
def peak_activation_bytes(
    runner: ModelRunner,
    num_tokens: int,
    template: MultiModalItem | None = None,
    cross_template: tuple[MultiModalItem, int] | None = None,
) -> int:
    """The memory a step needs beyond weights and KV cache, measured: the larger of one text-only prefill
    of num_tokens (through a scratch KV cache) and, for a vision model whose encoder runs eagerly (no
    encoder graphs, whose pool is taken before this), encoding as many copies of `template` as a step of
    num_tokens overlaps; plus the encoder cache's bound (its capacity in rows at the LM's width).

    A cross-attention family's prefill attends `template`'s encoder output. A tensor-parallel worker, which
    holds no encoder, gets `cross_template` instead, (the driver's template without pixels, its encoder tokens),
    and attends zeros of that shape: every rank must run the same layers, whose collectives pair up."""
    if runner.device.type != "cuda":
        return 0
    if runner.model.family.encoder_decoder and template is None and cross_template is None:
        logger.warning(
            "no activation profile: an encoder-decoder's decoder needs a picture's encoder output"
        )
        return 0
    encoder_peak = 0
    if template is not None and runner.encoder.graphs is None:
        item = runner.encoder.on_device(template)
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        base = torch.cuda.memory_allocated(runner.device)
        # cross-attention families encode a request's images when its first chunk runs, not per placeholder
        copies = (
            runner.cross_encode_batch
            if runner.model.family.cross_attention
            else cdiv(num_tokens, template.length) + 1
        )
        with runner.encoder.kernels():
            encoded = runner.model.get_mm_embeddings([item] * copies)
        torch.cuda.synchronize(runner.device)
        encoder_peak = torch.cuda.max_memory_allocated(runner.device) - base
        row_bytes = encoded[0][0].numel() * encoded[0].element_size()
        del encoded
    with scratch_kv_cache(runner, num_tokens):
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        base = torch.cuda.memory_allocated(runner.device)
        hidden_row_bytes = profile_prefill(runner, num_tokens, template, cross_template)
        torch.cuda.synchronize(runner.device)
        peak = torch.cuda.max_memory_allocated(runner.device) - base
    torch.cuda.empty_cache()
    if template is not None and runner.encoder.graphs is not None:
        row_bytes = hidden_row_bytes
    cache_bound = runner.encoder.cache.capacity * row_bytes if template else 0
    return max(peak, encoder_peak) + cache_bound


def _prompt_blocks(runner: ModelRunner, num_tokens: int) -> int:
    """Blocks of the profile's prompt of num_tokens: its scratch cache and its block table."""
    return cdiv(num_tokens, runner.block_size) + 1


@contextmanager
def scratch_kv_cache(runner: ModelRunner, num_tokens: int) -> Iterator[None]:
    """A KV cache for the profile's prompt of num_tokens; the runner's own (if any) is back afterwards."""
    saved = runner.kv_caches, [layer.kv_cache for layer in runner.attn_layers]
    runner.allocate_kv_cache(_prompt_blocks(runner, num_tokens))
    try:
        yield
    finally:
        runner.kv_caches = saved[0]
        for layer, cache in zip(runner.attn_layers, saved[1]):
            layer.kv_cache = cache


@torch.inference_mode()
def profile_prefill(
    runner: ModelRunner,
    num_tokens: int,
    template: MultiModalItem | None = None,
    cross_template: tuple[MultiModalItem, int] | None = None,
) -> int:
    """The profile's forward pass, on any device, through the runner's current KV cache (`scratch_kv_cache`):
    one prompt of num_tokens, attending `template`'s encoder output (cross-attention families; zeros shaped as
    `cross_template` says on a tensor-parallel worker), and its last 64 rows' logits. Returns the bytes of one
    hidden-state row. Every tensor-parallel rank runs it at once, with the same collectives."""
    dev = runner.device
    blocks = _prompt_blocks(runner, num_tokens)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=dev),
        query_start_loc_cpu=[0, num_tokens],
        seq_lens_cpu=[num_tokens],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        block_size=runner.block_size,
    )
    positions = torch.arange(num_tokens, device=dev)
    if runner.model.family.mrope:
        positions = positions.expand(3, -1)
    embeds = runner.model.embed_input_ids(torch.zeros(num_tokens, dtype=torch.int64, device=dev))
    if runner.model.family.cross_attention and (template is not None or cross_template is not None):
        # the prompt attends one picture's encoder output, as a request's steps do (an encoder-decoder's
        # decoder has nothing to attend without it)
        if template is not None:
            item = runner.encoder.on_device(template)
            with runner.encoder.kernels():
                states = runner.model.get_mm_embeddings([item])[0]
        else:
            item, encoder_tokens = cross_template
            states = embeds.new_zeros(encoder_tokens, embeds.shape[-1])
        pool = CrossKVPool(
            runner.model.cross_kv_layout(),
            runner.dtype,
            cdiv(len(states), runner.block_size),
            runner.block_size,
            dev,
        )  # a scratch pool of its blocks
        pool_blocks = list(range(pool.num_blocks))
        pool.write(runner.model.cross_kv(states), pool_blocks)
        meta.cross = CrossAttentionBatch(
            [
                CrossAttentionSeq(
                    slice(0, num_tokens),
                    0,
                    num_tokens,
                    [item],
                    torch.tensor(pool_blocks, device=dev),
                    len(states),
                )
            ],
            pool.caches,
            0,
            None,
            runner.attn_layers[0].backend,
        )
        del states
    hidden = runner.model(embeds, positions, meta)
    runner.model.compute_logits(hidden[-64:])
    return embeds.shape[-1] * embeds.element_size()


def kv_pool_blocks(runner: ModelRunner, cache_config: CacheConfig, activation_peak: int = 0) -> int:
    """Pool size: fixed, else a fraction of the GPU memory free after weights and the activation
    peak (like TensorRT-LLM's kv_cache_free_gpu_mem_fraction), else kv_cache_size_gb on CPU. A
    cross-attention family keeps `cross_kv_cache_fraction` of that budget for its requests' encoder
    keys/values (`cross_kv_budget`, bytes; with a fixed pool, in that proportion to it)."""
    runner.cross_kv_budget = 0
    if cache_config.num_blocks is not None:
        if runner.model.family.cross_attention:
            f = cache_config.cross_kv_cache_fraction
            runner.cross_kv_budget = int(
                cache_config.num_blocks * runner.kv_bytes_per_block() * f / (1 - f)
            )
        return cache_config.num_blocks
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
        free, _ = torch.cuda.mem_get_info(runner.device)
        budget = max(0, free - activation_peak) * cache_config.kv_cache_memory_fraction
        source = (
            f"kv_cache_memory_fraction {cache_config.kv_cache_memory_fraction} of the "
            f"{free / 2**30:.2f} GiB free after the weights, less the activation peak of "
            f"{activation_peak / 2**30:.2f} GiB"
        )
    else:
        budget = cache_config.kv_cache_size_gb * 2**30
        source = f"kv_cache_size_gb {cache_config.kv_cache_size_gb}"
    if runner.model.family.cross_attention:
        runner.cross_kv_budget = int(budget * cache_config.cross_kv_cache_fraction)
        budget -= runner.cross_kv_budget
        source += f", less cross_kv_cache_fraction {cache_config.cross_kv_cache_fraction} of it"
    blocks = int(budget // runner.kv_bytes_per_block())
    if blocks < 2:
        raise ValueError(
            f"the KV cache would get {blocks} blocks of {runner.kv_bytes_per_block()} bytes "
            f"({source}): free GPU memory, raise the fraction or the size, or set num_blocks"
        )
    return blocks
