"""LLM: the offline API. Batch-generate from prompts (text + images) or chat messages."""

from __future__ import annotations

import itertools
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mmserve.core.outputs import RequestOutput, one_output
from mmserve.engine.engine import Engine
from mmserve.models.hub import resolve_checkpoint
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.sampling_params import RequestLimits, SamplingParams, choice_params

# prompts preprocessed ahead of the engine's waiting queue: enough to keep a step's token budget fed while
# the next ones are processed, few enough that preprocessing threads do not crowd the engine out of the GIL
PREPROCESS_AHEAD = 16


class LLM:
    """Offline generation over one checkpoint: a local directory or a hub model ID (`revision`, `download_dir`;
    `HF_HUB_OFFLINE=1` reads the hub cache only).

    Example:
        llm = LLM(model_dir)
        outs = llm.generate([{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "images": [img]}],
                            SamplingParams(max_tokens=16, temperature=0.0))
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        *,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_fraction: float = 0.9,
        kv_cache_size_gb: float = 1.0,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        cross_kv_cache_fraction: float = 0.5,
        prompt_end_cache_size: int = 1024,
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: bool = True,
        quantization: str | None = None,
        media: MediaConfig | None = None,
        lora_modules: dict[str, str] | None = None,
        max_loras: int = 8,
        preprocess_on_gpu: bool = True,
        tensor_parallel_size: int = 1,
        mm_encoder_tp_mode: str = "driver",
        max_stop_sequences: int = RequestLimits.max_stop_sequences,
        max_stop_sequence_chars: int = RequestLimits.max_stop_sequence_chars,
        revision: str | None = None,
        download_dir: str | None = None,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                resolve_checkpoint(model, revision, download_dir),
                dtype=dtype,
                device=device,
                max_model_len=max_model_len,
                seed=seed,
                attention_backend=attention_backend,
                enforce_eager=enforce_eager,
                quantization=quantization,
                max_loras=max_loras,
                tensor_parallel_size=tensor_parallel_size,
                mm_encoder_tp_mode=mm_encoder_tp_mode,
                preprocess_on_gpu=preprocess_on_gpu,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_kv_blocks,
                kv_cache_memory_fraction=kv_cache_memory_fraction,
                kv_cache_size_gb=kv_cache_size_gb,
                kv_cache_dtype=kv_cache_dtype,
                enable_prefix_caching=enable_prefix_caching,
                prompt_end_cache_size=prompt_end_cache_size,
                cross_kv_cache_fraction=cross_kv_cache_fraction,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                async_scheduling=async_scheduling,
            ),
            limits=RequestLimits(
                max_stop_sequences=max_stop_sequences,
                max_stop_sequence_chars=max_stop_sequence_chars,
            ),
        )
        # the user's own process: local files (relative to the working directory) and private URLs are theirs
        local = MediaConfig(allow_private_urls=True, allowed_local_media_path=os.sep)
        self.engine = Engine(config, media or local)
        try:
            for name, path in (lora_modules or {}).items():  # prompts name one with {"lora": name}
                self.engine.add_lora(name, path)
        except BaseException:
            self.engine.close()  # no tensor-parallel worker outlives a constructor that failed
            raise
        self._ids = itertools.count()
        self._preprocess = ThreadPoolExecutor(4, thread_name_prefix="mmserve-llm-preprocess")

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also end with this process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | list,
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in input order.

        Prompts are preprocessed (media loading, the HF processor) on a few threads while the engine runs
        the ones already admitted, a bounded number ahead of what the engine has queued (so preprocessing
        does not crowd the engine's thread out of the GIL). A bad prompt raises its error after every
        request of this call was aborted, so the engine stays clean.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        if any(
            p.n > 1 for p in plist
        ):  # n sequences of a prompt: n requests (seed + i), one output of n completions
            sizes = [p.n for p in plist]
            outs = self.generate(
                [pr for pr, k in zip(prompts, sizes) for _ in range(k)],
                [q for p in plist for q in choice_params(p, p.n)],
                use_tqdm,
            )
            merged, at = [], 0
            for k in sizes:
                merged.append(one_output(outs[at : at + k]))
                at += k
            return merged
        futures: list[Future] = []
        ids: list[str] = []
        try:
            return self._run(prompts, plist, futures, ids, use_tqdm)
        except BaseException:
            for f in futures:
                f.cancel()
            for rid in ids:
                self.engine.abort(rid)
            raise

    def beam_search(
        self,
        prompts: str | dict | list,
        beam_width: int,
        params: SamplingParams | None = None,
        length_penalty: float = 1.0,
    ) -> list[RequestOutput]:
        """Beam search (engine/beam_search.py) for each prompt, all at once in continuous batches; each output has
        `beam_width` completions, best first (max_tokens, min_tokens, end id, stop strings and token sequences,
        repetition / presence / frequency penalties, logit bias and one-token bad words of `params` apply; the
        sampling knobs do not)."""
        import asyncio

        from mmserve.engine.async_engine import AsyncEngine
        from mmserve.engine.beam_search import beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params or SamplingParams()
        if self.engine.has_unfinished():
            raise RuntimeError(
                "beam_search needs the engine to itself (requests are still running)"
            )
        engine = AsyncEngine(
            self.engine
        )  # the engine's step loop on its thread while this one waits

        async def one(prompt) -> RequestOutput:
            inputs = await engine.preprocess(prompt)
            return await beam_search(
                engine, inputs, params, beam_width, length_penalty, f"beams-{next(self._ids)}"
            )

        async def run() -> list[RequestOutput]:
            return list(await asyncio.gather(*(one(p) for p in prompts)))

        try:
            return asyncio.run(run())
        finally:
            engine.shutdown()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to OpenAI-style messages (content parts text, image_url, video_url)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.engine.inputs.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run(
        self,
        prompts: list,
        plist: list[SamplingParams],
        futures: list[Future],
        ids: list[str],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Preprocess prompts (`futures`) at most PREPROCESS_AHEAD beyond the engine's waiting queue, admit them in
        order as they become ready (waiting for one only when the engine has nothing to run) and step the engine
        until all are done; `ids` collects the admitted request ids."""
        done: dict[str, RequestOutput] = {}
        engine = self.engine
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm or len(prompts) < 2)
        while len(ids) < len(prompts) or engine.has_unfinished():
            ahead = len(futures) - len(ids) + len(engine.scheduler.waiting)
            for p in prompts[len(futures) : len(futures) + max(0, PREPROCESS_AHEAD - ahead)]:
                futures.append(self._preprocess.submit(engine.preprocess, p))
            while len(ids) < len(futures) and (
                futures[len(ids)].done() or not engine.has_unfinished()
            ):
                i = len(ids)
                rid = str(next(self._ids))
                engine.add_processed(rid, futures[i].result(), plist[i], stream=False)
                ids.append(rid)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
