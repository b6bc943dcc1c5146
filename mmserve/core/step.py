"""The scheduler -> runner contract of one step: what is scheduled (SchedulerOutput, a ScheduledRequest per
request with tokens in it) and what the runner gives back (RunnerOutput); the kind of a step."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from mmserve.engine.request import Request
    from mmserve.worker.prompt_logprobs import PromptLogprobs

STEP_KINDS = ("decode", "prefill", "mixed")


def step_kind(num_tokens_per_seq: list[int]) -> str:
    """'decode' if every sequence computes one token, 'prefill' if none does, else 'mixed'."""
    ones = sum(1 for n in num_tokens_per_seq if n == 1)
    if ones == len(num_tokens_per_seq):
        return "decode"
    return "prefill" if ones == 0 else "mixed"


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute token positions [start, start + num_tokens).

    num_tokens == 0: nothing to compute; the request samples its first token from the prompt-end slot
    `load_prompt_end`. store_prompt_end: the chunk completes the prompt, and its last position's hidden state
    goes to that slot."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    samples: bool = False  # the chunk reaches the request's last token, so a new token is sampled
    load_prompt_end: int | None = None
    store_prompt_end: int | None = None
    block_row: int = -1  # the row of block_ids in SchedulerOutput.block_table (-1: none)
    end: int = field(
        init=False
    )  # start + num_tokens: a field, read several times per request per step

    def __post_init__(self) -> None:
        self.end = self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # [rows, width] int32 on the host: each running request's block ids in its row (ScheduledRequest.block_row),
    # 0 past them; the KV manager's array, valid until the next schedule
    block_table: np.ndarray | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @functools.cached_property
    def computed(self) -> list[ScheduledRequest]:
        """The requests with tokens to compute (all but the prompt-end loads, which come last)."""
        n = len(self.scheduled)
        while n and self.scheduled[n - 1].num_tokens == 0:
            n -= 1
        return self.scheduled if n == len(self.scheduled) else self.scheduled[:n]

    @functools.cached_property
    def kind(self) -> str:
        """'decode', 'prefill' or 'mixed' (step_kind) of the computed requests ('decode' if none);
        read after scheduling is complete."""
        return step_kind([s.num_tokens for s in self.computed])

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    """Per request that sampled this step: the new token and, when asked, its logprobs."""

    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    ranks: dict[str, int | None] = field(
        default_factory=dict
    )  # rank of the sampled id (1 = most likely)
    # prompt positions [start, start + n) of requests that asked for context logits: (start, [n, V] fp32 cpu)
    context_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    generation_logits: dict[str, torch.Tensor] = field(default_factory=dict)  # [V] fp32 cpu
    prompt_logprobs: dict[str, PromptLogprobs] = field(
        default_factory=dict
    )  # requests with prompt_logprobs
