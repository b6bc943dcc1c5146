"""Request: the engine's state for one generation request (tokens, multimodal items, progress)."""

from __future__ import annotations

import enum
import time

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.core.outputs import Logprob
from mmserve.core.stop_matcher import TokenSequenceMatcher
from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampling_batch import plain_greedy_from
from mmserve.worker.step_batch import PLACEHOLDER  # an output id still being sampled (async)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED_STATES


_FINISHED_STATES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


class Request:
    """Token state of one request. The scheduling rule: num_computed_tokens chases num_tokens."""

    # those a step reads of every request first, so they share the object's first cache lines (on the host of a
    # step hundreds of requests are read several times, after the forward has evicted them); then the rest, and
    # a __dict__ for anything else
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "num_computed_tokens",
        "max_output_tokens",
        "num_pending",
        "last_sample_row",
        "num_registered_blocks",
        "params",
        "status",
        "stream",
        "grammar",
        "bad_words",
        "stop_sequences",
        "plain_sampling_from",
        "first_token_time",
        "prompt_positions",
        "position_delta",
        "mm_items",
        "lora",
        "prompt",
        "cross_blocks_needed",
        "cross_block_ids",
        "cross_kv_written",
        "cross_kv_tokens",
        "cross_kv_order",
        "cross_decode_len",
        "hash_salt",
        "eos_token_ids",
        "arrival_time",
        "first_scheduled_time",
        "preprocess_times",
        "encode_times",
        "num_images",
        "num_videos",
        "output_logprobs",
        "cumulative_logprob",
        "num_cached_tokens",
        "num_preemptions",
        "stop_reason",
        "block_hashes",
        "prompt_digest",
        "generator",
        "context_logits",
        "num_context_logits",
        "prompt_logprobs",
        "generation_logits",
        "__dict__",
        "__weakref__",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        mm_items: list[MultiModalItem] | None = None,
        eos_token_ids: tuple[int, ...] = (),
        bad_words_ids: list[list[int]] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.mm_items = list(mm_items or [])  # in prompt order (ProcessedInputs sorts them)
        # cross-attention families: the pool blocks holding the encoder's keys/values, which every step of the
        # request attends (engine/cross_blocks.py, worker/cross_kv.py)
        self.cross_blocks_needed = (
            0  # known before encoding: the scheduler admits it when they are free
        )
        self.cross_block_ids: list[int] | None = (
            None  # held from admission to finish / abort / preemption
        )
        self.cross_kv_written = False  # its encoder ran and filled them
        self.cross_kv_tokens = 0  # encoder tokens in them
        self.cross_kv_order = (
            None  # pool position -> encoder column (None: identity), set when written
        )
        self.cross_decode_len = 0  # how many of them (from the first) its generated tokens attend
        self.lora: str | None = None  # the LoRA adapter its steps apply (LoRAManager), if any
        self.grammar = None  # guided decoding: its xgrammar matcher (engine/guided.py), if any
        self.hash_salt: bytes | None = (
            None  # parent digest of its first KV block (the adapter's), if any
        )
        self.eos_token_ids = eos_token_ids  # the ids that end it as EOS (none with ignore_eos)
        # bad words as token ids and the stop token sequences, matched against the output ids as they arrive
        # (fill_pending): the ids a bad word would complete next (the sampler masks them), whether one ended
        self.bad_words = TokenSequenceMatcher(bad_words_ids) if bad_words_ids else None
        self.stop_sequences = (
            TokenSequenceMatcher(params.stop_token_sequences)
            if params.stop_token_sequences
            else None
        )
        # the output length from which its next token is the plain argmax of its logits (plain_greedy_from)
        self.plain_sampling_from = plain_greedy_from(params, self.bad_words)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # for request traces: (start, end) of its preprocessing (AsyncEngine) and of the step(s) that ran its
        # vision encoder (Engine._launch), wall clock; a float per event, nothing per token
        self.preprocess_times: tuple[float, float] | None = None
        self.encode_times: tuple[float, float] | None = None
        self.num_images = sum(1 for m in self.mm_items if m.modality == "image")
        self.num_videos = sum(1 for m in self.mm_items if m.modality == "video")

        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens that came from the prefix cache (first schedule)
        self.num_preemptions = 0
        self.stream = True  # False: the engine reports only the finished output
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[
            bytes
        ] = []  # chained sha256 digests of this request's full blocks (kv_cache.hash_block)
        # of its full blocks, those registered for prefix hits (KVCacheManager; None: it holds no blocks)
        self.num_registered_blocks: int | None = None
        self.prompt_digest: bytes | None = (
            None  # of the whole prompt (KVCacheManager.prompt_digest), once made
        )
        self.generator: torch.Generator | None = None  # per-request RNG when params.seed is set
        self.context_logits: list[torch.Tensor] = []  # [n, V] fp32 chunks of prompt-position logits
        self.num_context_logits = 0  # prompt positions whose logits are stored
        self.prompt_logprobs: list = []  # prompt_logprobs: entries of prompt tokens 1 .. P - 1
        self.generation_logits: list[torch.Tensor] = []  # [V] fp32 per generated token
        # prompt positions: [3, P] of M-RoPE families, [1, P] of a family's own 1-D ones; None: the indices
        self.prompt_positions: torch.Tensor | None = None
        self.position_delta = 0  # generated token at p sits at p + delta
        self.max_output_tokens = params.max_tokens  # the engine lowers it to what fits
        # async scheduling: the last `num_pending` output ids are PLACEHOLDER until their step's tokens
        # reach the host; `last_sample_row` is this request's row among the latest launched step's samples
        self.num_pending = 0
        self.last_sample_row = -1

    def positions(self, start: int, end: int) -> torch.Tensor | range:
        """Rotary positions of tokens [start, end): a range (for M-RoPE families the same on all three axes,
        as for generated tokens), or [3, n] ([1, n]: a family's own 1-D positions) for prompt tokens."""
        if self.prompt_positions is None:
            return range(start, end)
        p = self.num_prompt_tokens
        if start >= p:  # decode: no tensor per request per step
            return range(start + self.position_delta, end + self.position_delta)
        parts = []
        if start < p:
            parts.append(self.prompt_positions[:, start : min(end, p)])
        if end > p:
            gen = torch.arange(max(start, p), end) + self.position_delta
            parts.append(gen.expand(len(self.prompt_positions), -1))
        return torch.cat(parts, dim=1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but the pending placeholders)."""
        return self.num_tokens - self.num_pending

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_output_tokens - self.num_pending

    def add_pending(self, row: int) -> None:
        """A launched step samples this request's next token into `row` of its output."""
        self.output_token_ids.append(PLACEHOLDER)
        self.num_pending += 1
        self.last_sample_row = row

    def fill_pending(self, token: int) -> None:
        """The oldest pending token arrived (the output's token matchers take it)."""
        self.output_token_ids[len(self.output_token_ids) - self.num_pending] = token
        self.num_pending -= 1
        if self.bad_words is not None:
            self.bad_words.feed(token)
        if self.stop_sequences is not None:
            self.stop_sequences.feed(token)

    def note_encode(self, start: float, end: float) -> None:
        """A step that runs this request's vision encoder was launched from `start` to `end` (wall clock); over several
        chunks, the first one's start to the last one's end."""
        self.encode_times = (self.encode_times[0] if self.encode_times else start, end)

    def drop_pending(self) -> None:
        """Forget tokens still in flight (the request finished before they arrived)."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending :]
            self.num_pending = 0

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def mm_items_in(self, start: int, end: int) -> list[MultiModalItem]:
        """Multimodal items whose placeholder span overlaps token positions [start, end)."""
        items = self.mm_items
        if (
            not items or items[-1].end <= start
        ):  # sorted, disjoint spans: the last ends last (decodes)
            return []
        return [m for m in items if m.offset < end and m.end > start]

    @property
    def finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
