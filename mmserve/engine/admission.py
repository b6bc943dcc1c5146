"""The admission room of the engine: every check a request passes before it is queued, and the `Request` it
becomes (its EOS and stop ids, bad words, grammar, LoRA salt, prefix-cache hashes, seed, output budget).

Each check raises ValueError naming the field and the limit (`EngineOverloaded` when too many wait), before
the request costs anything.
"""

from __future__ import annotations

import torch

from mmserve.config import EngineConfig
from mmserve.core.multimodal import ProcessedInputs
from mmserve.engine.guided import GrammarCache
from mmserve.engine.kv_cache import KVCacheManager
from mmserve.engine.request import Request
from mmserve.engine.scheduler import Scheduler
from mmserve.lora import LoRAManager
from mmserve.sampling_params import SamplingParams
from mmserve.worker.model_runner import ModelRunner


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; callers should retry later (HTTP 503)."""


class Admission:
    """Turns (request id, processed inputs, sampling params) into a checked `Request`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_model_len: int,
        vocab_size: int,
        image_token_id: int | None,
        tokenizer,
        default_eos: tuple[int, ...],
        kv: KVCacheManager,
        scheduler: Scheduler,
        grammars: GrammarCache,
        lora: LoRAManager,
        runner: ModelRunner,
        device: torch.device,
    ) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.tokenizer = tokenizer
        self.default_eos = default_eos
        self.kv = kv
        self.scheduler = scheduler
        self.grammars = grammars
        self.lora = lora
        self.runner = runner  # its cross-attention pool, if the family has one
        self.device = device

    def admit(self, request_id: str, inputs: ProcessedInputs, params: SamplingParams) -> Request:
        """The checked request (not queued yet)."""
        if params.n != 1:
            raise ValueError(
                f"n: the engine runs one sequence per request (got {params.n}); LLM.generate and the "
                "servers run n sequences as n requests"
            )
        self.config.limits.check(
            params
        )  # before the lists cost anything (bad words are tokenized below)
        waiting = len(self.scheduler.waiting)
        if waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloaded(f"{waiting} requests are already waiting")
        n = len(inputs.prompt_token_ids)
        capacity = min(self.max_model_len, self.kv.num_blocks * self.kv.block_size)
        if n >= capacity:
            raise ValueError(
                f"the prompt has {n} tokens but at most {capacity - 1} fit (max_model_len "
                f"{self.max_model_len}, KV cache {self.kv.num_blocks * self.kv.block_size} tokens)"
            )
        self._check_vocabulary(inputs, params)
        guide = self._guide(params)
        eos = (
            ()
            if params.ignore_eos
            else ((params.eos_token_id,) if params.eos_token_id is not None else self.default_eos)
        )
        bad = [self.tokenizer.encode(w, add_special_tokens=False) for w in params.bad_words]
        bad += params.bad_token_sequences
        cross_blocks = self._cross_blocks(inputs)
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
        req.prompt_positions, req.position_delta = inputs.prompt_positions, inputs.position_delta
        req.lora, req.hash_salt = (
            inputs.lora,
            self.lora.hash_salt(inputs.lora),
        )  # unknown: ValueError
        if inputs.block_hashes is not None and inputs.block_hashes[0] == self.kv.block_size:
            req.block_hashes = list(
                inputs.block_hashes[1]
            )  # the request's own: it grows as it decodes
        if params.seed is not None:
            req.generator = torch.Generator(self.device).manual_seed(params.seed)
        req.max_output_tokens = min(params.max_tokens, capacity - n)
        return req

    def _check_vocabulary(self, inputs: ProcessedInputs, params: SamplingParams) -> None:
        vocab = self.vocab_size
        if inputs.prompt_token_ids and max(inputs.prompt_token_ids) >= vocab:
            outside = set(t for t in inputs.prompt_token_ids if t >= vocab)
            if (
                inputs.mm_items
            ):  # Mllama's <|image|> has an embedding past the vocabulary the LM head predicts
                outside.discard(self.image_token_id)
            if outside:
                raise ValueError(
                    f"prompt_token_ids contain ids outside the vocabulary (size {vocab})"
                )
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(
                f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary (size {vocab})"
            )

    def _guide(self, params: SamplingParams):
        """The request's grammar (AsyncEngine compiled it beforehand on a preprocessing thread: it is cached)."""
        if params.guided_decoding_type is None:
            return None
        guide = self.grammars.guide(params.guided_decoding_type, params.guided_decoding_guide)
        for tok in params.guided_decoding_prefix:
            if not guide.accept_token(tok):
                raise ValueError(f"guided_decoding_prefix: token {tok} is outside the guide")
        return guide

    def _cross_blocks(self, inputs: ProcessedInputs) -> int:
        """Blocks of the cross-attention pool the request's encoder outputs need (0 without the pool)."""
        pool = self.runner.cross_kv
        if pool is None:
            return 0
        tokens = sum(self.runner.model.cross_kv_tokens(it) for it in inputs.mm_items)
        blocks = pool.num_blocks_of(tokens)
        if blocks > pool.num_blocks:
            per_token, room = pool.bytes_per_token, pool.num_blocks * pool.block_size
            raise ValueError(
                f"images: their encoder keys/values ({tokens} tokens, "
                f"{tokens * per_token / 2**20:.2f} MiB) do not fit the {room} tokens "
                f"({room * per_token / 2**20:.2f} MiB) kept for them (cross_kv_cache_fraction)"
            )
        return blocks
