"""OutputProcessor.resolve's short way (a request without a grammar, matchers or per-token text only fills its
placeholder) against applying every token the long way: the same finishes, at the same token, with the same reason,
text, ids and streamed outputs."""

from __future__ import annotations

import random
import types

import pytest

from mmserve.core.step import RunnerOutput, ScheduledRequest, SchedulerOutput
from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.engine.output_processor import OutputProcessor, Tracked, decodes_per_token
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.request_output import finish_status
from mmserve.engine.step_stats import StepStats
from mmserve.sampling_params import SamplingParams


class _Tokenizer:
    """One letter per id."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        max_tokens=rng.randint(2, 12),
        min_tokens=rng.choice([0, 0, 2]),
        stop_token_ids=rng.sample(range(26), rng.choice([0, 1, 3])),
        stop=rng.choice([[], [], ["cd"], ["e"]]),
        stop_token_sequences=rng.choice([[], [], [[3, 4]]]),
        ignore_eos=rng.random() < 0.3,
    )


def _requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(12):
        params = _params(rng)
        eos = () if params.ignore_eos else (25,)
        req = Request(f"r{i}", None, [1, 2, 3], params, eos_token_ids=eos)
        req.max_output_tokens = min(params.max_tokens, rng.randint(1, 12))
        req.stream = rng.random() < 0.5
        reqs.append(req)
    return reqs


def _finished(out) -> tuple:
    c = out.outputs[0]
    return out.request_id, out.finished, c.text, list(c.token_ids), c.finish_reason, c.stop_reason


def _long_way(reqs: list[Request], tokens: list[list[int]]) -> list[list[tuple]]:
    """Every token through fill_pending, the detokenizer and finish_status (the engine's rules, one by one)."""
    detoks = {
        r.request_id: IncrementalDetokenizer(_Tokenizer(), r.prompt_token_ids, r.params)
        for r in reqs
    }
    live, steps = list(reqs), []
    for step_tokens in tokens:
        for r in live:
            r.add_pending(0)
        outs = []
        for r, token in zip(list(live), step_tokens):
            detok = detoks[r.request_id]
            r.fill_pending(token)
            if decodes_per_token(r):
                detok.push(token)
            stop_ids = set(r.params.stop_token_ids) | set(r.eos_token_ids)
            status = finish_status(r, token, detok, stop_ids)
            if status is not None:
                r.status = status
                if not detok.finished:
                    if not decodes_per_token(r):
                        detok.extend(r.output_token_ids[len(detok.token_ids) :])
                    detok.flush()
                live.remove(r)
                outs.append(
                    (
                        r.request_id,
                        True,
                        detok.text,
                        list(r.output_token_ids),
                        status.value,
                        r.stop_reason,
                    )
                )
            elif r.stream:
                outs.append(
                    (r.request_id, False, detok.text, list(r.output_token_ids), None, r.stop_reason)
                )
        steps.append(outs)
    return steps


def _resolved(reqs: list[Request], tokens: list[list[int]]) -> list[list[tuple]]:
    """The same tokens through OutputProcessor.resolve, a step at a time."""
    table = {r.request_id: r for r in reqs}
    proc = OutputProcessor(
        _Tokenizer(),
        table,
        lambda r, status: setattr(r, "status", status),
        lambda reqs: None,
        StepStats(),
    )
    for r in reqs:
        proc.track(r)
    steps = []
    for step_tokens in tokens:
        live = list(table.values())
        for row, r in enumerate(live):
            r.add_pending(row)
        sched = SchedulerOutput([ScheduledRequest(r, r.num_tokens - 1, 1, [], True) for r in live])
        out = RunnerOutput(token_ids={r.request_id: t for r, t in zip(live, step_tokens)})
        launched = types.SimpleNamespace(result=lambda out=out: out, wait_s=0.0)
        steps.append([_finished(o) for o in proc.resolve(sched, launched)])
    assert not proc.tracked and not table  # every request finished and was forgotten
    return steps


@pytest.mark.parametrize("seed", range(8))
def test_resolve_finishes_and_streams_as_token_by_token_rules_do(seed):
    rng = random.Random(seed)
    tokens = [[rng.randrange(26) for _ in range(12)] for _ in range(13)]
    assert _resolved(_requests(seed), tokens) == _long_way(_requests(seed), tokens)


def test_tracked_state_says_which_short_way_a_request_takes():
    proc = OutputProcessor(_Tokenizer(), {}, lambda r, s: None, lambda reqs: None, StepStats())
    plain = Request("a", None, [1], SamplingParams(stop_token_ids=[5]), eos_token_ids=(2,))
    plain.stream = False
    words = Request("b", None, [1], SamplingParams(stop=["x"]))
    words.stream = False
    sequences = Request("c", None, [1], SamplingParams(stop_token_sequences=[[1, 2]]))
    sequences.stream = False
    streamed = Request("d", None, [1], SamplingParams())
    for r in (plain, words, sequences, streamed):
        proc.track(r)
    state = {rid: (t.stop_ids, t.per_token) for rid, t in proc.tracked.items()}
    assert state == {
        "a": ({5, 2}, False),
        "b": (set(), True),  # stop strings need the text of each token
        "c": (set(), False),
        "d": (set(), True),  # streamed: its text grows per token
    }
    assert isinstance(proc.tracked["a"], Tracked) and proc.tracked["a"].detok.text == ""
    assert RequestStatus.FINISHED_STOPPED.value == "stop"
