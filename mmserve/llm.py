"""LLM: the offline API. Batch-generate from prompts (text + images) or chat messages."""
from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm import tqdm

from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from mmserve.engine.engine import Engine
from mmserve.multimodal.inputs import MediaConfig
from mmserve.outputs import RequestOutput
from mmserve.sampling_params import SamplingParams


class LLM:
    """Offline generation over one checkpoint.

    Example:
        llm = LLM(model_dir)
        outs = llm.generate([{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:", "images": [img]}],
                            SamplingParams(max_tokens=16, temperature=0.0))
    """

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", *, max_num_seqs: int = 64,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 2048, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory_fraction: float = 0.9,
                 kv_cache_size_gb: float = 1.0, kv_cache_dtype: str = "auto", enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, seed: int = 0, attention_backend: str = "auto",
                 enforce_eager: bool = False, async_scheduling: bool = True, quantization: str | None = None,
                 media: MediaConfig | None = None) -> None:
        config = EngineConfig(
            model=ModelConfig(model, dtype=dtype, device=device, max_model_len=max_model_len, seed=seed,
                              attention_backend=attention_backend, enforce_eager=enforce_eager,
                              quantization=quantization),
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                              kv_cache_memory_fraction=kv_cache_memory_fraction, kv_cache_size_gb=kv_cache_size_gb,
                              kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      enable_chunked_prefill=enable_chunked_prefill,
                                      async_scheduling=async_scheduling))
        self.engine = Engine(config, media or MediaConfig(allow_private_urls=True))
        self._ids = itertools.count()
        self._preprocess = ThreadPoolExecutor(4, thread_name_prefix="mmserve-llm-preprocess")

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in input order.

        A bad prompt raises before any request is queued, so the engine stays clean.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        # media loading and the HF processor run on a few threads (they release the GIL in torch/PIL)
        if len(prompts) == 1:
            processed = [self.engine.inputs.process(prompts[0])]
        else:
            processed = list(self._preprocess.map(self.engine.inputs.process, prompts))
        ids = []
        try:
            for inputs, p in zip(processed, plist):
                rid = str(next(self._ids))
                self.engine.add_processed(rid, inputs, p, stream=False)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to OpenAI-style messages (content parts text, image_url, video_url)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.engine.inputs.apply_chat_template(conv) for conv in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm or len(ids) < 2)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
