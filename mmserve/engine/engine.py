"""Engine: the synchronous core. add_request / step / abort; step = schedule -> launch -> resolve.

Start-up (`engine/startup.py`) builds the parts; admission (`engine/admission.py`) checks and builds requests;
the outputs room (`engine/output_processor.py`) applies launched steps and finishes requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from mmserve.config import EngineConfig
from mmserve.core.multimodal import ProcessedInputs
from mmserve.core.outputs import RequestOutput
from mmserve.core.step import SchedulerOutput
from mmserve.engine.admission import Admission
from mmserve.engine.guided import GrammarCache
from mmserve.engine.kv_cache import chain_block_hashes
from mmserve.engine.output_processor import OutputProcessor
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.startup import start_engine, stop_workers
from mmserve.engine.step_stats import StepStats
from mmserve.lora.trtllm_format import adapter_from_trtllm
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.sampling_params import SamplingParams
from mmserve.worker.launched_step import LaunchedStep

logger = logging.getLogger(__name__)
SLOW_STEP_S = 0.5  # host time of one step above which it is logged
SLOW_SHAPES_KEPT = 4096  # step shapes whose first slow step was logged (~0.1 KB each); later new ones count as seen


class Engine:
    def __init__(self, config: EngineConfig, media: MediaConfig | None = None) -> None:
        self.config = config
        parts = start_engine(config, media)
        self.device, self.tp_workers = parts.device, parts.tp_workers
        self.hf_config, self.text_config = parts.hf_config, parts.text_config
        self.dtype, self.model, self.inputs = parts.dtype, parts.model, parts.inputs
        self.runner, self.lora, self.kv = parts.runner, parts.lora, parts.kv
        self.scheduler, self.model_info = parts.scheduler, parts.model_info
        self.default_eos = parts.default_eos
        self.tokenizer = self.inputs.tokenizer
        self.max_model_len = self.model_info.max_model_len
        self.grammars = GrammarCache(
            self.tokenizer, self.text_config.vocab_size, list(self.default_eos)
        )
        self.requests: dict[str, Request] = {}
        self.step_stats = StepStats()
        self.admission = Admission(
            config,
            max_model_len=self.max_model_len,
            vocab_size=self.text_config.vocab_size,
            image_token_id=self.inputs.image_token_id,
            tokenizer=self.tokenizer,
            default_eos=self.default_eos,
            kv=self.kv,
            scheduler=self.scheduler,
            grammars=self.grammars,
            lora=self.lora,
            runner=self.runner,
            device=self.device,
        )
        self.outputs = OutputProcessor(
            self.tokenizer,
            self.requests,
            self.scheduler.finish,
            self.kv.cache_computed_blocks_of,
            self.step_stats,
        )
        self._inflight: tuple[SchedulerOutput, LaunchedStep] | None = None  # tokens not read yet
        self._slow_shapes: set[tuple] = set()  # shapes of slow steps logged (_log_slow_step)
        self._slow_logged_at = float("-inf")

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do at TP=1)."""
        stop_workers(self.runner, self.tp_workers)
        self.tp_workers = None

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
        req = self.admission.admit(request_id, inputs, params)
        req.stream = stream
        self.outputs.track(req)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def encode_media(self, inputs: ProcessedInputs) -> list[torch.Tensor]:
        """The embeddings of `inputs`' pictures and videos through the vision tower and projector, one
        [item.length, hidden] float32 host tensor per item in prompt order (the runner's encoder, its cache and
        graphs); no request, no KV blocks. On the engine's thread, between steps (under TP the driver, or
        every rank with --mm-encoder-tp-mode data)."""
        encoded = self.runner.encoder.encode(inputs.mm_items)
        return [encoded[item.content_hash].float().cpu() for item in inputs.mm_items]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and free its blocks; returns its final output (None if unknown)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self.outputs.final_output(req)

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
        if self._inflight is not None and self.outputs.needs_history:
            outputs = self.outputs.resolve(*self._inflight)
            self._inflight = None
        sched = self.scheduler.schedule()
        launched = self._launch(sched) if not sched.empty else None
        previous, self._inflight = self._inflight, (sched, launched) if launched else None
        if previous is not None:
            outputs += self.outputs.resolve(*previous)
        if self._inflight is not None and not self.config.scheduler.async_scheduling:
            outputs += self.outputs.resolve(*self._inflight)
            self._inflight = None
        self._record_step(sched, launched, t0, waited_before)
        return outputs

    def _launch(self, sched: SchedulerOutput) -> LaunchedStep:
        """Queue the scheduled step on the device (after the in-flight one) and advance its requests."""
        started, launched_at = time.time(), None
        try:
            launched = self.runner.launch(sched, self._inflight[1] if self._inflight else None)
        except BaseException:
            self._forget_prompt_end_stores(sched)
            raise
        row = prompt_tokens = 0
        for s in sched.scheduled:
            req, start, end = s.request, s.start, s.end
            num_prompt = len(req.prompt_token_ids)
            if start < num_prompt:
                prompt_tokens += min(end, num_prompt) - start
                if req.mm_items and req.mm_items_in(start, end):
                    # a prompt chunk with pictures: when its encoder ran, for its trace
                    launched_at = launched_at or time.time()
                    req.note_encode(started, launched_at)
            req.num_computed_tokens = end
            if s.samples:
                req.add_pending(row)
                row += 1
        # register full blocks now, not when the step is read back: a request admitted by the next
        # schedule may hit them (its reads are queued after this step's writes)
        self.kv.cache_computed_blocks_of(s.request for s in sched.scheduled)
        self.step_stats.prompt_tokens += prompt_tokens
        self.step_stats.sampled_tokens += row
        return launched

    def _record_step(
        self, sched: SchedulerOutput, launched: LaunchedStep | None, t0: float, waited_before: float
    ) -> None:
        host_s = time.perf_counter() - t0 - (self.step_stats.device_wait_s - waited_before)
        if launched is None:
            self.step_stats.idle_host_s += host_s
            return
        # its prompt and sampled tokens were counted when it launched (_launch)
        self.step_stats.launched(sched.kind, sched.num_batched_tokens, len(sched.scheduled), host_s)
        if host_s > SLOW_STEP_S:
            self._log_slow_step(sched, host_s)

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

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
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
            "encoder_cache_hit_rate": self.runner.encoder.cache.hit_rate,
            "encoder_cache_hits": self.runner.encoder.cache.hits,
            "encoder_cache_queries": self.runner.encoder.cache.hits
            + self.runner.encoder.cache.misses,
            "prompt_end_cache_hits": self.scheduler.prompt_ends.hits
            if self.scheduler.prompt_ends
            else 0,
            "num_preemptions": self.scheduler.num_preemptions,
            "cross_kv_cache_usage": cross.usage
            if (cross := self.scheduler.cross_blocks) is not None
            else 0.0,
            "cross_kv_cache_blocks_total": cross.num_blocks if cross is not None else 0,
            "running_lora_adapters": _lora_names(self.scheduler.running),
            "waiting_lora_adapters": _lora_names(self.scheduler.waiting),
            "max_loras": self.config.model.max_loras,
        }


def _lora_names(requests) -> str:
    """The adapters of these requests, comma-separated, sorted (the LoRA info gauge's label)."""
    return ",".join(sorted({r.lora for r in list(requests) if r.lora is not None}))
