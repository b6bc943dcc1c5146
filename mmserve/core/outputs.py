"""What the engine returns: RequestOutput (one request) holding CompletionOutput (one sequence).

Outputs are cumulative: each RequestOutput of a stream carries all text and tokens so far;
`delta_*` helpers in the frontends take the difference.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token id, with its decoded text."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # one dict per generated token: {token_id: Logprob} with the chosen id and the top-k ids
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_media_tokens: int = 0  # prompt tokens that are pictures' / videos' (their placeholder runs)
    num_images: int = 0  # pictures in the prompt
    num_videos: int = 0
    # wall-clock times (time.time()) for request traces (entrypoints/tracing.py); None where it did not happen
    preprocess_start_time: float | None = None  # AsyncEngine.preprocess: media load + processor
    preprocess_end_time: float | None = None
    # the launch of the step(s) running its vision encoder (Engine._launch)
    encode_start_time: float | None = None
    encode_end_time: float | None = None
    # a served request's way to its first response bytes (time.monotonic()); None offline
    phases: PhaseTimes | None = None


# A served request's phases to its first response bytes, in order, and the events that end them: `receive` runs
# from the call's start (ASGI app / gRPC handler) to the engine taking it, `media` loads its pictures,
# `preprocess` runs the processor (waiting for a thread included), `queue` from the hand-off to the engine thread
# to its first scheduling, `first_step` to its first token on the host, `first_byte` to the first response bytes
# handed to the transport after it (a response that is not streamed: the whole response).
PHASES = ("receive", "media", "preprocess", "queue", "first_step", "first_byte")
PHASE_EVENTS = (
    "received",
    "handed",
    "media_loaded",
    "preprocessed",
    "scheduled",
    "first_token",
    "first_byte",
)


@dataclass
class PhaseTimes:
    """The monotonic times (time.monotonic()) of PHASE_EVENTS one HTTP request / gRPC call reached. Each is kept
    as first marked: the engine requests of one call (several choices, a batch) share it, the first to get
    somewhere marks it."""

    stamps: dict[str, float] = field(default_factory=dict)

    def mark(self, event: str, at: float | None = None) -> None:
        self.stamps.setdefault(event, time.monotonic() if at is None else at)

    def reached(self, event: str) -> bool:
        return event in self.stamps

    def durations(self) -> dict[str, float] | None:
        """Seconds per phase (PHASES), or None while an event is missing."""
        s = self.stamps
        if len(s) < len(PHASE_EVENTS) or not all(e in s for e in PHASE_EVENTS):
            return None
        return {
            phase: s[end] - s[start]
            for phase, start, end in zip(PHASES, PHASE_EVENTS, PHASE_EVENTS[1:])
        }


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # fp32 logits of each prompt position [P, V] / each generated token [G, V], when asked for
    context_logits: object | None = None
    generation_logits: object | None = None
    # SamplingParams.prompt_logprobs: one {token id: Logprob} per prompt token (None for the first), once the
    # prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)


def one_output(outs: list[RequestOutput]) -> RequestOutput:
    """Several requests of one prompt (each one sequence) as one output whose completions are theirs, in order
    (SamplingParams.n offline, Triton num_return_sequences)."""
    return dataclasses.replace(
        outs[0], outputs=[dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    )
