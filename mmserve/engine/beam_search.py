"""Beam search (Triton `beam_width` > 1, `length_penalty`), as transformers' `generate(num_beams=W,
early_stopping=True)` and TensorRT-LLM's default early stopping choose beams.

`BeamSearch` is the bookkeeping: each step every running beam offers its 2W most likely next tokens; the 2W best
(beam score + log-prob) candidates are taken in order, an end-of-sequence candidate among the first W finishing a
hypothesis scored `sum of log-probs / length ** length_penalty`, the others running on until W run; a candidate
that ends with a stop sequence (a stop string as its own tokens) finishes as an end id does, its tokens kept. It is
done when W hypotheses finished (early stopping) or the beams reached max_tokens (then the running ones count too).

`beam_search` drives it on an AsyncEngine without touching the scheduler or the KV cache: each step, each running
beam is an engine request of prompt + the beam's tokens that computes one token with its top-2W log-probs; the
prompt and every full KV block of the beam come from the prefix cache, so a step computes at most a block's worth
of tokens per beam (the same request again, or a sibling's fork of it). Presence / frequency penalties over the
beam's tokens go into that request as a logit bias (its own output is one token), and a guided-decoding grammar
starts there past the beam's tokens; its mask comes before the log-probs, so every candidate keeps to it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from mmserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from mmserve.engine.request_output import ends_with_any
from mmserve.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 10  # 2W log-probs per step, and the sampler reports at most 20


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    score: float = 0.0  # sum of the log-probs

    def normalized(self, length_penalty: float) -> float:
        return self.score / (len(self.tokens) ** length_penalty) if self.tokens else self.score


class BeamSearch:
    def __init__(
        self,
        width: int,
        max_tokens: int,
        eos_ids: set[int],
        length_penalty: float = 1.0,
        stop_sequences: Sequence[Sequence[int]] = (),
    ) -> None:
        if not 1 <= width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {width}")
        self.width, self.max_tokens, self.eos_ids, self.length_penalty = (
            width,
            max_tokens,
            eos_ids,
            length_penalty,
        )
        # a candidate whose tokens end with one of these ends its hypothesis as an end id does (the tokens stay)
        self.stop_sequences = [list(seq) for seq in stop_sequences if seq]
        self.running = [Beam()]
        self.finished: list[tuple[float, Beam]] = []  # (normalized score, hypothesis), best first

    @property
    def done(self) -> bool:
        return (
            len(self.finished) >= self.width
            or not self.running
            or len(self.running[0].tokens) >= self.max_tokens
        )

    def step(self, candidates: list[list[tuple[int, float]]]) -> None:
        """candidates[i]: the 2W most likely (token, log-prob) after running beam i."""
        ranked = sorted(
            (
                (beam.score + lp, -i, tok, lp)
                for i, beam in enumerate(self.running)
                for tok, lp in candidates[i]
            ),
            reverse=True,
        )[: 2 * self.width]
        running = []
        for rank, (score, neg_i, tok, lp) in enumerate(ranked):
            parent = self.running[-neg_i]
            beam = Beam(parent.tokens + [tok], parent.logprobs + [lp], score)
            if tok in self.eos_ids or self.ends_with_stop(beam.tokens):
                if rank < self.width:
                    self._finish(beam)
                continue
            running.append(beam)
            if len(running) == self.width:
                break
        self.running = running

    def ends_with_stop(self, tokens: list[int]) -> bool:
        return ends_with_any(tokens, self.stop_sequences)

    def _finish(self, beam: Beam) -> None:
        self.finished.append((beam.normalized(self.length_penalty), beam))
        self.finished.sort(key=lambda h: -h[0])
        del self.finished[self.width :]

    def results(self) -> list[Beam]:
        """The W best hypotheses, best first; beams cut by max_tokens count when fewer than W finished."""
        if len(self.finished) < self.width:
            for beam in self.running:
                self._finish(beam)
        return [beam for _, beam in self.finished]


def check_length_penalty(value: float) -> float:
    """The beams' length penalty as a float; ValueError naming it unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"length_penalty must be a finite number, got {value!r}")
    return float(value)


def unsupported_with_beams(params: SamplingParams) -> str | None:
    """The first SamplingParams field set that beam search does not apply (yet), or None."""
    return "prompt_logprobs" if params.prompt_logprobs is not None else None


def stop_sequences(params: SamplingParams, tokenizer) -> list[list[int]]:
    """What ends a hypothesis besides the end id: the token stop sequences, and each stop string tokenized on its
    own (no special tokens), as TensorRT-LLM's preprocessing turns stop words into its stop_words_list."""
    return [
        *params.stop_token_sequences,
        *(tokenizer.encode(s, add_special_tokens=False) for s in params.stop),
    ]


def step_params(params: SamplingParams, width: int, beam_tokens: list[int]) -> SamplingParams:
    """The one-token request of a beam whose tokens so far are `beam_tokens` (they are part of the request's
    prompt): its top-2W log-probs; min_tokens as the beam's; the presence / frequency penalties over the beam's
    tokens, as a logit bias (the engine would count only the request's own output); a guide continues from the
    beam's tokens (guided_decoding_prefix)."""
    bias = dict(params.logit_bias)
    if params.presence_penalty or params.frequency_penalty:
        for tok, count in Counter(beam_tokens).items():
            bias[tok] = (
                bias.get(tok, 0.0) - params.presence_penalty - params.frequency_penalty * count
            )
    return dataclasses.replace(
        params,
        max_tokens=1,
        min_tokens=1 if len(beam_tokens) < params.min_tokens else 0,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=None,
        logprobs=2 * width,
        stop=[],
        stop_token_sequences=[],
        presence_penalty=0.0,
        frequency_penalty=0.0,
        logit_bias=bias,
        return_context_logits=False,
        return_generation_logits=False,
        guided_decoding_prefix=list(beam_tokens) if params.guided_decoding_type else [],
    )


async def beam_search(
    engine, inputs, params: SamplingParams, width: int, length_penalty: float, request_id: str
) -> RequestOutput:
    """Run beam search for one preprocessed prompt on an AsyncEngine; the final output carries W completions."""
    last = None
    async for last in beam_search_steps(engine, inputs, params, width, length_penalty, request_id):
        pass
    return last


async def beam_search_steps(
    engine,
    inputs,
    params: SamplingParams,
    width: int,
    length_penalty: float,
    request_id: str,
    snapshots: bool = False,
    stop: asyncio.Event | None = None,
) -> AsyncIterator[RequestOutput]:
    """beam_search as a stream: with `snapshots`, after each step an unfinished output holding W beams so far (the
    running ones best first, then hypotheses already finished; they may change order or be replaced from one step
    to the next, so each carries whole beams, as TensorRT-LLM streams beams); always the final output last. Once
    `stop` is set the search ends after the step in flight: the final output holds those W beams, finish reason
    "abort"."""
    inner = engine.engine
    inner.config.limits.check(
        params
    )  # as Engine.add_processed: the step requests carry no stop lists
    eos = (
        set()
        if params.ignore_eos
        else ({params.eos_token_id} if params.eos_token_id is not None else set(inner.default_eos))
    )
    search = BeamSearch(
        width, params.max_tokens, eos, length_penalty, stop_sequences(params, inner.tokenizer)
    )

    async def offers(i: int, beam: Beam) -> list[tuple[int, float]]:
        beam_inputs = dataclasses.replace(
            inputs,
            prompt_token_ids=inputs.prompt_token_ids + beam.tokens,
            block_hashes=None,
            prompt_positions=_prompt_positions(inputs, len(beam.tokens)),
        )
        last = None
        async for out in engine.generate_processed(
            beam_inputs,
            step_params(params, width, beam.tokens),
            f"{request_id}-beam{len(beam.tokens)}-{i}",
        ):
            last = out
        entry = last.outputs[0].logprobs[0]
        ranked = sorted(
            ((lp.logprob, tok) for tok, lp in entry.items() if lp.logprob > float("-inf")),
            reverse=True,
        )
        return [(tok, lp) for lp, tok in ranked[: 2 * width]]

    def output(beams: list[Beam], finished: bool, aborted: bool = False) -> RequestOutput:
        completions = []
        for k, beam in enumerate(beams):
            ended = (
                bool(beam.tokens) and beam.tokens[-1] in eos
            )  # the end id is not text; a stop word is
            text_ids = beam.tokens[:-1] if ended else beam.tokens
            stopped = ended or search.ends_with_stop(beam.tokens)
            reason = ("stop" if stopped else "abort" if aborted else "length") if finished else None
            completions.append(
                CompletionOutput(
                    k,
                    inner.tokenizer.decode(
                        text_ids, skip_special_tokens=params.skip_special_tokens
                    ),
                    list(beam.tokens),
                    cumulative_logprob=beam.score,
                    logprobs=[{tok: Logprob(lp)} for tok, lp in zip(beam.tokens, beam.logprobs)],
                    finish_reason=reason,
                )
            )
        return RequestOutput(
            request_id, inputs.prompt, list(inputs.prompt_token_ids), completions, finished
        )

    def current() -> list[
        Beam
    ]:  # W beams, as clients index them: the running ones, then finished ones
        return (search.running + [beam for _, beam in search.finished])[:width]

    while not search.done:
        if stop is not None and stop.is_set():
            yield output(current(), True, aborted=True)
            return
        search.step(await asyncio.gather(*(offers(i, b) for i, b in enumerate(search.running))))
        if snapshots and not search.done:
            yield output(current(), False)
    yield output(search.results(), True)


def _prompt_positions(inputs, generated: int):
    """M-RoPE families: the prompt's [3, P] positions extended over the beam's tokens (text: p + delta on each axis)."""
    if inputs.prompt_positions is None or not generated:
        return inputs.prompt_positions
    p = inputs.prompt_positions.shape[1]
    tail = (
        torch.arange(p, p + generated, dtype=inputs.prompt_positions.dtype) + inputs.position_delta
    )
    return torch.cat(
        [inputs.prompt_positions, tail.expand(len(inputs.prompt_positions), -1)], dim=1
    )
