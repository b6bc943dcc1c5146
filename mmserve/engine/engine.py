"""Engine: the synchronous core. add_request / step / abort; step = schedule -> run -> update."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import GenerationConfig

from mmserve.config import EngineConfig, resolve_device
from mmserve.core.multimodal import ProcessedInputs
from mmserve.core.outputs import Logprob, RequestOutput
from mmserve.core.step import RunnerOutput, SchedulerOutput
from mmserve.engine.cross_blocks import CrossBlockAllocator
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.guided import GrammarCache
from mmserve.engine.kv_cache import KVCacheManager, chain_block_hashes
from mmserve.engine.prompt_end_cache import PromptEndCache
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.request_output import finish_status, request_output
from mmserve.engine.scheduler import Scheduler
from mmserve.engine.step_stats import StepStats
from mmserve.lora import LoRAManager
from mmserve.lora.trtllm_format import adapter_from_trtllm
from mmserve.models.loader import load_hf_config, load_model
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.multimodal.processors import InputProcessor
from mmserve.sampling_params import SamplingParams
from mmserve.worker.launched_step import LaunchedStep
from mmserve.worker.model_runner import ModelRunner
from mmserve.worker.prompt_logprobs import entries as prompt_logprob_entries
from mmserve.worker.tp_workers import TPWorkers, check_tensor_parallel, rank_device

logger = logging.getLogger(__name__)
SLOW_STEP_S = 0.5  # host time of one step above which it is logged
SLOW_SHAPES_KEPT = 4096  # step shapes whose first slow step was logged (~0.1 KB each); later new ones count as seen


def _decodes_per_token(req: Request) -> bool:
    """Streamed requests and those with stop strings need their text as each token arrives; the rest (offline
    batches) decode it once, when they finish."""
    return req.stream or bool(req.params.stop)


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; callers should retry later (HTTP 503)."""


class Engine:
    def __init__(self, config: EngineConfig, media: MediaConfig | None = None) -> None:
        self.config = config
        mc = config.model
        self.device = resolve_device(mc.device)
        self.tp_workers = None
        if mc.tensor_parallel_size > 1:
            check_tensor_parallel(load_hf_config(mc.model), mc)
            self.device = rank_device(self.device, 0)
            self.tp_workers = TPWorkers.start(config, self.device)
        try:
            self._build(config, media)
        except BaseException:
            self.close()  # no worker process outlives an engine that failed to start
            raise

    def _build(self, config: EngineConfig, media: MediaConfig | None) -> None:
        """Everything of __init__ after the processes: the model, the runner and its KV cache, the scheduler."""
        mc = config.model
        loaded = load_model(mc, self.device)
        self.hf_config, self.text_config, self.dtype, self.model = (
            loaded.hf_config,
            loaded.text_config,
            loaded.dtype,
            loaded.model,
        )
        preprocess_device = (
            self.device if self.device.type == "cuda" and mc.preprocess_on_gpu else None
        )
        self.inputs = InputProcessor(
            mc.model, self.hf_config, type(self.model), media, preprocess_device
        )
        self.tokenizer = self.inputs.tokenizer
        # T5's relative positions have no table size: 4096 unless max_model_len says otherwise
        self.max_model_len = min(
            mc.max_model_len or 1 << 30,
            getattr(self.text_config, "max_position_embeddings", None) or 4096,
        )
        self.runner = ModelRunner(
            self.model,
            self.device,
            self.dtype,
            config.cache,
            self.text_config.vocab_size,
            mc.attention_backend,
        )
        self.runner.tp = self.tp_workers
        if self.tp_workers is not None:
            own_bytes, worker_bytes = self._on_every_rank("weight_bytes", ())
            logger.info(
                "tensor parallelism over %d ranks: weights %s GiB here (with the encoders), %s GiB on the "
                "workers",
                len(worker_bytes) + 1,
                f"{own_bytes / 2**30:.2f}",
                ", ".join(f"{b / 2**30:.2f}" for b in worker_bytes),
            )
        self.lora = self.runner.lora = LoRAManager(
            self.model, self.device, self.dtype, mc.max_loras
        )
        prompt_ends = None
        if config.cache.enable_prefix_caching and config.cache.prompt_end_cache_size:
            prompt_ends = PromptEndCache(config.cache.prompt_end_cache_size)
            self.runner.allocate_prompt_ends(prompt_ends.num_slots)
        blank = self._blank_image_item()
        if (
            not mc.enforce_eager
        ):  # before the KV cache is sized: the encoder graphs' memory is not free for it
            self.runner.capture_encoder_graphs(blank, config.scheduler.max_num_batched_tokens)
        profile_tokens = min(config.scheduler.max_num_batched_tokens, self.max_model_len)
        here, workers = self._profile_templates(blank)
        num_blocks, others = self._on_every_rank(
            "plan_kv_cache",
            (config.cache, profile_tokens, *here),
            (config.cache, profile_tokens, *workers),
        )
        num_blocks = min([num_blocks] + others)
        self._on_every_rank("allocate_kv_cache", (num_blocks,))
        cross_blocks, others = self._on_every_rank("cross_kv_num_blocks", ())
        self._on_every_rank(
            "allocate_cross_kv", (min([cross_blocks] + others),)
        )  # the same block ids everywhere
        self.runner.warm_up_sampler()
        if not mc.enforce_eager:
            self._on_every_rank(
                "capture_cuda_graphs",
                (
                    config.scheduler.max_num_seqs,
                    self.max_model_len,
                    config.scheduler.max_num_batched_tokens,
                    self._cross_tokens(blank),
                ),
            )
        self.kv = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, prompt_ends)
        if self.runner.cross_kv is not None:
            self.scheduler.cross_blocks = CrossBlockAllocator(self.runner.cross_kv.num_blocks)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._stop_ids: dict[str, set[int]] = {}
        self._slow_shapes: set[tuple] = set()  # shapes of slow steps logged (_log_slow_step)
        self._slow_logged_at = float("-inf")
        self._needs_history: set[str] = (
            set()
        )  # requests whose sampling reads their previous tokens on the host
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = (
            None  # launched, tokens not read yet
        )
        self.step_stats = StepStats()
        self.default_eos = self._eos_ids()
        self.grammars = GrammarCache(
            self.tokenizer, self.text_config.vocab_size, list(self.default_eos)
        )
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens (%s)",
            type(self.model).__name__,
            self.device,
            self.dtype,
            num_blocks,
            config.cache.block_size,
            self.runner.kv_dtype,
        )

    def _on_every_rank(
        self, name: str, args: tuple, worker_args: tuple | None = None
    ) -> tuple[Any, list]:
        """runner.name(*args) here and, under tensor parallelism, on every worker at once (worker_args if given):
        (this rank's result, the workers' results)."""
        pending = (
            self.tp_workers.call(name, *(args if worker_args is None else worker_args))
            if self.tp_workers is not None
            else None
        )
        result = getattr(self.runner, name)(*args)
        return result, pending() if pending is not None else []

    def _cross_tokens(self, blank) -> int | None:
        """A cross-attention family's encoder tokens for the blank picture: the shape of the tensor-parallel
        workers' profile and of the cross-attention decode graphs, the same on every rank (None: no such family
        or no picture)."""
        if blank is None or not self.runner.uses_cross_attention:
            return None
        return self.model.cross_kv_tokens(blank)

    def _profile_templates(self, blank) -> tuple[tuple, tuple]:
        """The activation profile's picture arguments (`ModelRunner.plan_kv_cache` / `profile_prefill`), here and
        on the tensor-parallel workers. Workers encode no pictures: their profile is the language model's alone,
        and a cross-attention family's attends zeros of the picture's shape where this rank's attends its
        encoder output, so that every rank runs the same layers and collectives."""
        tokens = self._cross_tokens(blank)
        cross = (
            (self.model.cross_item_layout(blank), tokens)
            if tokens is not None and self.tp_workers is not None
            else None
        )
        return (blank,), (None, cross)

    def _blank_image_item(self):
        """A blank picture's encoder inputs, for warming up the encoder graphs and for the memory profile of the
        vision encoder (None: not on CUDA, or no image input)."""
        if self.device.type != "cuda":
            return None
        try:
            return self.inputs.blank_image_item()
        except (
            Exception
        ) as exc:  # best effort: graphs are then captured on first use, the profile is text-only
            logger.warning(
                "no vision encoder warm-up or profile: a blank picture does not preprocess (%r)",
                exc,
            )
            return None

    def _eos_ids(self) -> tuple[int, ...]:
        """The tokenizer's EOS, then any other EOS ids of the checkpoint's generation_config.json (Llama 3
        instruct models end turns with <|eot_id|> but may also emit <|end_of_text|> or <|eom_id|>), as
        transformers' generate stops on each."""
        ids = [getattr(self.tokenizer, "eos_token_id", None)]
        try:
            extra = GenerationConfig.from_pretrained(self.config.model.model).eos_token_id
        except OSError:  # no generation_config.json
            extra = None
        ids += extra if isinstance(extra, list) else [extra]
        return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do at TP=1)."""
        if self.tp_workers is not None:
            if hasattr(self, "runner"):
                self.runner.release_cuda_graphs()  # before the group goes (ModelRunner.release_cuda_graphs)
            self.tp_workers.close()
            self.tp_workers = None
            if hasattr(self, "runner"):
                self.runner.tp = None

    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT LoRA adapter at `path`; prompts name it with {"lora": name}. ValueError if it does not fit."""
        self.lora.add(name, path)
        if self.tp_workers is not None:  # each worker loads its shard of the adapter
            self.tp_workers.call("lora_sync", [], name, str(path), False)()
        logger.info(
            "LoRA adapter %r loaded from %s (rank %d, %d layers)",
            name,
            path,
            self.lora.get(name).rank,
            len(self.lora.get(name).targets),
        )

    def add_lora_tensors(self, name: str, weights, config) -> None:
        """Serve the adapter sent as TensorRT-LLM tensors (Triton `lora_weights` [rows, width], `lora_config`
        [rows, 3]; lora/trtllm_format.py) as `name`, as TensorRT-LLM caches a task's adapter (LoRAManager.put)."""
        adapter = adapter_from_trtllm(name, weights, config, self.model, self.device, self.dtype)
        before = set(self.lora.adapters)
        if self.lora.put(adapter, held={r.lora for r in self.requests.values()}):
            logger.info(
                "LoRA adapter %r loaded from request tensors (%d modules)",
                name,
                len(adapter.targets),
            )
            if (
                self.tp_workers is not None
            ):  # the workers evict what this rank evicted and load their shards
                self.tp_workers.call(
                    "lora_sync",
                    sorted(before - set(self.lora.adapters)),
                    name,
                    (weights, config),
                    True,
                )()

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | dict[str, Any], params: SamplingParams
    ) -> Request:
        """Validate and queue a request. Raises ValueError/TypeError for bad input, EngineOverloaded when full."""
        return self.add_processed(request_id, self.preprocess(prompt), params)

    def preprocess(self, prompt: str | dict[str, Any]) -> ProcessedInputs:
        """InputProcessor.process, plus the prompt's chained KV block hashes for the prefix cache; thread-safe, so
        servers and LLM.generate run it off the engine thread. An exact repeat comes back as the same object
        from the processor's recent-inputs cache, its hashes already made."""
        inputs = self.inputs.process(prompt)
        bs = self.kv.block_size
        if self.kv.enable_prefix_caching and (
            inputs.block_hashes is None or inputs.block_hashes[0] != bs
        ):
            inputs.block_hashes = (
                bs,
                chain_block_hashes(
                    inputs.prompt_token_ids,
                    inputs.mm_items,
                    bs,
                    parent=self.lora.hash_salt(inputs.lora),
                ),
            )
        return inputs

    def add_processed(
        self, request_id: str, inputs: ProcessedInputs, params: SamplingParams, stream: bool = True
    ) -> Request:
        """add_request after preprocess (which servers run off the engine thread).

        stream=False: step() reports this request only when it finishes (offline batches need no
        per-token outputs)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError(
                f"n: the engine runs one sequence per request (got {params.n}); LLM.generate and the "
                "servers run n sequences as n requests"
            )
        self.config.limits.check(
            params
        )  # before the lists cost anything (bad words are tokenized below)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests are already waiting")
        n = len(inputs.prompt_token_ids)
        capacity = min(self.max_model_len, self.kv.num_blocks * self.kv.block_size)
        if n >= capacity:
            raise ValueError(
                f"the prompt has {n} tokens but at most {capacity - 1} fit "
                f"(max_model_len {self.max_model_len}, KV cache {self.kv.num_blocks * self.kv.block_size} tokens)"
            )
        vocab = self.text_config.vocab_size
        if inputs.prompt_token_ids and max(inputs.prompt_token_ids) >= vocab:
            outside = set(t for t in inputs.prompt_token_ids if t >= vocab)
            if (
                inputs.mm_items
            ):  # Mllama's <|image|> has an embedding past the vocabulary the LM head predicts
                outside.discard(self.inputs.image_token_id)
            if outside:
                raise ValueError(
                    f"prompt_token_ids contain ids outside the vocabulary (size {vocab})"
                )
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(
                f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary (size {vocab})"
            )
        guide = None  # AsyncEngine compiles it beforehand on a preprocessing thread; here it is in the cache
        if params.guided_decoding_type is not None:
            guide = self.grammars.guide(params.guided_decoding_type, params.guided_decoding_guide)
            for tok in params.guided_decoding_prefix:
                if not guide.accept_token(tok):
                    raise ValueError(f"guided_decoding_prefix: token {tok} is outside the guide")
        eos = (
            ()
            if params.ignore_eos
            else ((params.eos_token_id,) if params.eos_token_id is not None else self.default_eos)
        )
        bad = [self.tokenizer.encode(w, add_special_tokens=False) for w in params.bad_words]
        bad += params.bad_token_sequences
        pool = self.runner.cross_kv
        cross_tokens = (
            sum(self.model.cross_kv_tokens(it) for it in inputs.mm_items) if pool is not None else 0
        )
        cross_blocks = pool.num_blocks_of(cross_tokens) if pool is not None else 0
        if cross_blocks > (pool.num_blocks if pool is not None else 0):
            per_token, room = pool.bytes_per_token, pool.num_blocks * pool.block_size
            raise ValueError(
                f"images: their encoder keys/values ({cross_tokens} tokens, "
                f"{cross_tokens * per_token / 2**20:.2f} MiB) do not fit the {room} tokens "
                f"({room * per_token / 2**20:.2f} MiB) kept for them (cross_kv_cache_fraction)"
            )
        req = Request(
            request_id,
            inputs.prompt,
            inputs.prompt_token_ids,
            params,
            inputs.mm_items,
            eos_token_ids=eos,
            bad_words_ids=[b for b in bad if b],
        )
        req.cross_blocks_needed = cross_blocks
        req.grammar = guide
        req.mrope_positions, req.mrope_delta = inputs.mrope_positions, inputs.mrope_delta
        req.lora, req.hash_salt = (
            inputs.lora,
            self.lora.hash_salt(inputs.lora),
        )  # ValueError: unknown adapter
        if inputs.block_hashes is not None and inputs.block_hashes[0] == self.kv.block_size:
            req.block_hashes = list(
                inputs.block_hashes[1]
            )  # the request's own list: it grows as it decodes
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        stop_ids = set(params.stop_token_ids) | set(eos)
        self._stop_ids[request_id] = stop_ids
        req.max_output_tokens = min(params.max_tokens, capacity - n)
        if _needs_history(req) or guide is not None:
            self._needs_history.add(request_id)
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, params
        )
        self.requests[request_id] = req
        req.stream = stream
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final output (None if unknown)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._finish_output(req)

    def has_unfinished(self) -> bool:
        # a launched step whose requests all finished needs nothing more; the next step() drops it
        return self.scheduler.has_unfinished()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that produced a token or finished.

        With async scheduling (the default) the step is queued on the device before the previous step's
        tokens are read back, so this host work overlaps the GPU's; a sampled token then reaches its
        request one call later. A request whose sampling reads its previous tokens on the host
        (penalties, multi-token bad words) makes the engine wait for them first while it runs.
        """
        t0, waited_before = time.perf_counter(), self.step_stats.device_wait_s
        outputs = []
        if self._inflight is not None and self._needs_history:
            outputs = self._resolve(*self._inflight)
            self._inflight = None
        sched = self.scheduler.schedule()
        launched = None
        if not sched.empty:
            try:
                launched = self.runner.launch(sched, self._inflight[1] if self._inflight else None)
            except BaseException:
                self._forget_prompt_end_stores(sched)
                raise
            row = 0
            for s in sched.scheduled:
                s.request.num_computed_tokens = s.end
                if s.samples:
                    s.request.add_pending(row)
                    row += 1
                # register full blocks now, not when the step is read back: a request admitted by the next
                # schedule may hit them (its reads are queued after this step's writes)
                self.kv.cache_computed_blocks(s.request)
        previous, self._inflight = (
            self._inflight,
            ((sched, launched) if launched is not None else None),
        )
        if previous is not None:
            outputs += self._resolve(*previous)
        if self._inflight is not None and not self.config.scheduler.async_scheduling:
            outputs += self._resolve(*self._inflight)
            self._inflight = None
        host_s = time.perf_counter() - t0 - (self.step_stats.device_wait_s - waited_before)
        if launched is None:
            self.step_stats.idle_host_s += host_s
        else:
            self.step_stats.launched(
                sched.kind, sched.num_batched_tokens, len(sched.scheduled), host_s
            )
            if host_s > SLOW_STEP_S:
                self._log_slow_step(sched, host_s)
        return outputs

    def _log_slow_step(self, sched: SchedulerOutput, host_s: float) -> None:
        """A shape's first slow step is most likely compiling kernels or capturing graphs; slow steps of a shape
        seen before are the host work itself (eager steps), logged at most once a minute."""
        shape = (sched.kind, sched.num_batched_tokens, len(sched.scheduled))
        what = "%s of %d tokens, %d sequences took %.0f ms on the host" % (*shape, host_s * 1000)
        if shape not in self._slow_shapes and len(self._slow_shapes) < SLOW_SHAPES_KEPT:
            self._slow_shapes.add(shape)
            logger.warning(
                "slow step: %s (a shape's first use compiles kernels or captures graphs)", what
            )
        elif time.monotonic() - self._slow_logged_at > 60:
            logger.warning(
                "slow step: %s, again for this shape: the host work of the step itself is slow",
                what,
            )
        else:
            return
        self._slow_logged_at = time.monotonic()

    def _forget_prompt_end_stores(self, sched: SchedulerOutput) -> None:
        """A step that failed to launch wrote no prompt-end rows: drop the slots the scheduler claimed for it."""
        for s in sched.scheduled:
            if s.store_prompt_end is not None:
                self.scheduler.prompt_ends.forget(self.kv.prompt_digest(s.request))

    def _resolve(self, sched: SchedulerOutput, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens back and apply them: detokenize, finish, cache full blocks."""
        result = launched.result()
        self.step_stats.waited(sched.kind, launched.wait_s)
        outputs = []
        now = time.time()
        for s in sched.scheduled:
            req = s.request
            if self.requests.get(req.request_id) is not req:
                continue  # finished or aborted while the step ran; its tokens are dropped
            self._store_context_logits(req, result)
            token = None
            if s.samples:
                token = result.token_ids[req.request_id]
                req.fill_pending(token)
                self._append_token(req, token, result)
                req.first_token_time = req.first_token_time or now
            self.kv.cache_computed_blocks(req)
            if token is None:
                continue
            status = finish_status(
                req, token, self._detok[req.request_id], self._stop_ids[req.request_id]
            )
            if status is not None:
                self.scheduler.finish(req, status)
                outputs.append(self._finish_output(req))
            else:
                if req.stream:
                    outputs.append(request_output(req, self._detok[req.request_id]))
        return outputs

    def _store_context_logits(self, req: Request, result: RunnerOutput) -> None:
        """Keep prompt-position logits and prompt logprobs once (a preempted request recomputes positions it
        already has)."""
        chunk = result.prompt_logprobs.get(req.request_id)
        if chunk is not None and 0 <= len(req.prompt_logprobs) - chunk.start < len(chunk.chosen):
            req.prompt_logprobs += prompt_logprob_entries(
                chunk,
                req.prompt_token_ids,
                len(req.prompt_logprobs) - chunk.start,
                self.tokenizer.decode,
            )
        if req.request_id not in result.context_logits:
            return
        start, chunk = result.context_logits[req.request_id]
        skip = req.num_context_logits - start
        if 0 <= skip < len(chunk):
            req.context_logits.append(chunk[skip:])
            req.num_context_logits += len(chunk) - skip

    def _append_token(self, req: Request, token: int, result: RunnerOutput) -> None:
        if req.grammar is not None and not req.grammar.accept_token(token):
            logger.warning(
                "%s: token %d is outside its guided-decoding grammar", req.request_id, token
            )
        if req.request_id in result.generation_logits:
            req.generation_logits.append(result.generation_logits[req.request_id])
        if _decodes_per_token(req):
            self._detok[req.request_id].push(token)
        if req.params.logprobs is not None and req.request_id in result.logprobs:
            lp = result.logprobs[req.request_id]
            req.cumulative_logprob += lp
            entry = {
                token: Logprob(lp, result.ranks.get(req.request_id), self.tokenizer.decode([token]))
            }
            for rank, (tid, tlp) in enumerate(result.top_logprobs.get(req.request_id, []), start=1):
                if tid != token:
                    entry[tid] = Logprob(tlp, rank, self.tokenizer.decode([tid]))
            req.output_logprobs.append(entry)

    # ---- outputs -------------------------------------------------------------------------
    def _finish_output(self, req: Request) -> RequestOutput:
        """The final output (held-back text released), then forget the request."""
        detok = self._detok[req.request_id]
        if not detok.finished:
            if not _decodes_per_token(req):  # its tokens were not pushed one by one (_append_token)
                detok.extend(
                    req.output_token_ids[len(detok.token_ids) : req.num_known_output_tokens]
                )
            detok.flush()
        req.drop_pending()
        out = request_output(req, detok)
        for table in (self._detok, self._stop_ids, self.requests):
            table.pop(req.request_id, None)
        self._needs_history.discard(req.request_id)
        return out

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_prefilling": sum(
                r.num_computed_tokens < r.num_prompt_tokens for r in self.scheduler.running
            ),
            "max_num_seqs": self.config.scheduler.max_num_seqs,
            "block_size": self.config.cache.block_size,
            "kv_cache_usage": self.kv.usage,
            "kv_cache_blocks_total": self.kv.num_blocks,
            "kv_cache_bytes_per_token": self.runner.kv_bytes_per_block()
            / self.config.cache.block_size,
            "prefix_cache_hit_rate": self.kv.stats.hit_rate,
            "prefix_cache_hit_tokens": self.kv.stats.hit_tokens,
            "prefix_cache_queried_tokens": self.kv.stats.queried_tokens,
            "encoder_cache_hit_rate": self.runner.encoder_cache.hit_rate,
            "prompt_end_cache_hits": self.scheduler.prompt_ends.hits
            if self.scheduler.prompt_ends
            else 0,
            "num_preemptions": self.scheduler.num_preemptions,
            "cross_kv_cache_usage": cross.usage
            if (cross := self.scheduler.cross_blocks) is not None
            else 0.0,
            "cross_kv_cache_blocks_total": cross.num_blocks if cross is not None else 0,
        }


def _needs_history(req: Request) -> bool:
    """Whether sampling this request's next token reads its previous tokens on the host (penalties; bad words of
    several ids, whose matcher must have taken every output id before the next is sampled)."""
    params = req.params
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or (req.bad_words is not None and req.bad_words.longest > 1)
    )
