"""Engine start-up, in one function that owns the order: load the model, build the runner, profile the memory,
size and allocate the KV pools, capture the CUDA graphs, then the KV manager and the scheduler over them.

The order matters: the encoder graphs are captured before the KV cache is sized (their memory is not free for
it); the profile runs before the pools are allocated; the decode graphs are captured after (they read the
pools' addresses). Under tensor parallelism every step that sizes or allocates runs on every rank at once and
the ranks agree on the smallest size (`on_every_rank`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from mmserve.config import EngineConfig, resolve_device
from mmserve.engine.cross_blocks import CrossBlockAllocator
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.model_info import ModelInfo
from mmserve.engine.prompt_end_cache import PromptEndCache
from mmserve.engine.scheduler import Scheduler
from mmserve.lora import LoRAManager
from mmserve.models.loader import load_hf_config, load_model
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.multimodal.processors import InputProcessor
from mmserve.worker.encoder_sharding import attach_encoder_sharding, host_item
from mmserve.worker.model_runner import ModelRunner
from mmserve.worker.tp_workers import TPWorkers, check_tensor_parallel, rank_device

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What start-up built, for the Engine to hold."""

    device: torch.device
    tp_workers: TPWorkers | None
    hf_config: Any
    text_config: Any
    dtype: torch.dtype
    model: torch.nn.Module
    inputs: InputProcessor
    runner: ModelRunner
    lora: LoRAManager
    kv: KVCacheManager
    scheduler: Scheduler
    model_info: ModelInfo
    default_eos: tuple[int, ...]


def on_every_rank(
    runner: ModelRunner,
    tp_workers: TPWorkers | None,
    name: str,
    args: tuple,
    worker_args: tuple | None = None,
) -> tuple[Any, list]:
    """runner.name(*args) here and, under tensor parallelism, on every worker at once (worker_args if given):
    (this rank's result, the workers' results)."""
    pending = (
        tp_workers.call(name, *(args if worker_args is None else worker_args))
        if tp_workers is not None
        else None
    )
    result = getattr(runner, name)(*args)
    return result, pending() if pending is not None else []


def start_engine(config: EngineConfig, media: MediaConfig | None) -> EngineParts:
    """Start the tensor-parallel workers (if any), then build everything on them; no worker process outlives a
    start-up that failed."""
    mc = config.model
    device = resolve_device(mc.device)
    tp_workers = None
    if mc.tensor_parallel_size > 1:
        check_tensor_parallel(load_hf_config(mc.model), mc)
        device = rank_device(device, 0)
        tp_workers = TPWorkers.start(config, device)
    runner = None
    try:
        loaded = load_model(mc, device)
        preprocess_device = device if device.type == "cuda" and mc.preprocess_on_gpu else None
        inputs = InputProcessor(
            mc.model, loaded.hf_config, type(loaded.model), media, preprocess_device
        )
        runner = ModelRunner(
            loaded.model,
            device,
            loaded.dtype,
            config.cache,
            loaded.text_config.vocab_size,
            mc.attention_backend,
        )
        runner.tp = tp_workers
        attach_encoder_sharding(runner, tp_workers, mc)
        return _build(config, device, tp_workers, loaded, inputs, runner)
    except BaseException:
        stop_workers(runner, tp_workers)
        raise


def stop_workers(runner: ModelRunner | None, tp_workers: TPWorkers | None) -> None:
    """Stop the tensor-parallel worker processes, the runner's CUDA graphs first (NCCL will not tear down a
    communicator a captured graph still uses: ModelRunner.release_cuda_graphs); nothing to do at TP=1."""
    if tp_workers is None:
        return
    if runner is not None:
        runner.release_cuda_graphs()
        runner.tp = None
    tp_workers.close()


def _build(config, device, tp_workers, loaded, inputs, runner) -> EngineParts:
    mc = config.model
    model = loaded.model
    split = runner.encoder.sharding is not None  # --mm-encoder-tp-mode data: each rank encodes
    # T5's relative positions have no table size: 4096 unless max_model_len says otherwise
    max_model_len = min(
        mc.max_model_len or 1 << 30,
        getattr(loaded.text_config, "max_position_embeddings", None) or 4096,
    )
    if tp_workers is not None:
        own_bytes, worker_bytes = on_every_rank(runner, tp_workers, "weight_bytes", ())
        logger.info(
            "tensor parallelism over %d ranks: weights %s GiB here (with the encoders), %s GiB on the "
            "workers%s",
            len(worker_bytes) + 1,
            f"{own_bytes / 2**30:.2f}",
            ", ".join(f"{b / 2**30:.2f}" for b in worker_bytes),
            " (with the encoders too)" if split else "",
        )
    lora = runner.lora = LoRAManager(model, device, loaded.dtype, mc.max_loras)
    prompt_ends = None
    if config.cache.enable_prefix_caching and config.cache.prompt_end_cache_size:
        prompt_ends = PromptEndCache(config.cache.prompt_end_cache_size)
        runner.allocate_prompt_ends(prompt_ends.num_slots)
    blank = blank_image_item(inputs, device)
    max_batched = config.scheduler.max_num_batched_tokens
    if (
        not mc.enforce_eager
    ):  # before the KV cache is sized: the encoder graphs' memory is not free for it
        encoder_workers = tp_workers if split else None
        here_args, worker_args = (blank, max_batched), (host_item(blank), max_batched)
        on_every_rank(runner, encoder_workers, "capture_encoder_graphs", here_args, worker_args)
    profile_tokens = min(max_batched, max_model_len)
    here, workers = profile_templates(model, blank, tp_workers is not None, split)
    num_blocks, others = on_every_rank(
        runner,
        tp_workers,
        "plan_kv_cache",
        (config.cache, profile_tokens, *here),
        (config.cache, profile_tokens, *workers),
    )
    num_blocks = min([num_blocks] + others)
    on_every_rank(runner, tp_workers, "allocate_kv_cache", (num_blocks,))
    cross_blocks, others = on_every_rank(runner, tp_workers, "cross_kv_num_blocks", ())
    # the same block ids everywhere
    on_every_rank(runner, tp_workers, "allocate_cross_kv", (min([cross_blocks] + others),))
    runner.warm_up_sampler()
    if not mc.enforce_eager:
        graph_shape = (
            config.scheduler.max_num_seqs,
            max_model_len,
            max_batched,
            cross_tokens(model, blank),
        )
        on_every_rank(runner, tp_workers, "capture_cuda_graphs", graph_shape)
    kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
    scheduler = Scheduler(config.scheduler, kv, prompt_ends)
    if runner.cross_kv is not None:
        scheduler.cross_blocks = CrossBlockAllocator(runner.cross_kv.num_blocks)
    info = ModelInfo(
        family=model.family,
        max_model_len=max_model_len,
        vocab_size=loaded.text_config.vocab_size,
        block_size=config.cache.block_size,
        image_token=inputs.image_token,
        video_token=inputs.video_token,
    )
    kv_tokens = num_blocks * config.cache.block_size
    logger.info(
        "engine ready: %s on %s (%s); KV cache %d tokens (%d blocks of %d, %s): %.1f requests of the "
        "full %d tokens at once (max_num_seqs %d)",
        type(model).__name__,
        device,
        loaded.dtype,
        kv_tokens,
        num_blocks,
        config.cache.block_size,
        runner.kv_dtype,
        kv_tokens / max_model_len,
        max_model_len,
        config.scheduler.max_num_seqs,
    )
    return EngineParts(
        device=device,
        tp_workers=tp_workers,
        hf_config=loaded.hf_config,
        text_config=loaded.text_config,
        dtype=loaded.dtype,
        model=model,
        inputs=inputs,
        runner=runner,
        lora=lora,
        kv=kv,
        scheduler=scheduler,
        model_info=info,
        default_eos=eos_ids(inputs.tokenizer, mc.model),
    )


def cross_tokens(model: torch.nn.Module, blank) -> int | None:
    """A cross-attention family's encoder tokens for the blank picture: the shape of the tensor-parallel
    workers' profile and of the cross-attention decode graphs, the same on every rank (None: no such family
    or no picture)."""
    if blank is None or not model.family.cross_attention:
        return None
    return model.cross_kv_tokens(blank)


def profile_templates(
    model: torch.nn.Module, blank, tensor_parallel: bool, workers_encode: bool = False
) -> tuple[tuple, tuple]:
    """The activation profile's picture arguments (`ModelRunner.plan_kv_cache` / `profile_prefill`), here and
    on the tensor-parallel workers. Workers encode no pictures: their profile is the language model's alone,
    and a cross-attention family's attends zeros of the picture's shape where this rank's attends its
    encoder output, so that every rank runs the same layers and collectives. `workers_encode`
    (--mm-encoder-tp-mode data): each worker profiles the encoding of the step's pictures too, as the driver
    does (a bound on its share: one picture may be the whole step's cost)."""
    if workers_encode:
        return (blank,), (host_item(blank), None)
    tokens = cross_tokens(model, blank)
    cross = (
        (model.cross_item_layout(blank), tokens) if tokens is not None and tensor_parallel else None
    )
    return (blank,), (None, cross)


def blank_image_item(inputs: InputProcessor, device: torch.device):
    """A blank picture's encoder inputs, for warming up the encoder graphs and for the memory profile of the
    vision encoder (None: not on CUDA, or no image input)."""
    if device.type != "cuda":
        return None
    try:
        return inputs.blank_image_item()
    except (
        Exception
    ) as exc:  # best effort: graphs are then captured on first use, the profile is text-only
        logger.warning(
            "no vision encoder warm-up or profile: a blank picture does not preprocess (%r)", exc
        )
        return None


def eos_ids(tokenizer: Any, model_dir: str) -> tuple[int, ...]:
    """The tokenizer's EOS, then any other EOS ids of the checkpoint's generation_config.json (Llama 3
    instruct models end turns with <|eot_id|> but may also emit <|end_of_text|> or <|eom_id|>), as
    transformers' generate stops on each."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    try:
        extra = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        extra = None
    ids += extra if isinstance(extra, list) else [extra]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))
