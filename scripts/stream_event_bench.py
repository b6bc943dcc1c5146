"""Host cost of one Triton generate_stream SSE event, the whole path against the per-stream encoder (CPU only,
< 1 minute).

`python scripts/stream_event_bench.py [--rounds 200] [--events 200]`

An event is what the route does per engine response: `make_outputs` (run.stream), then the `data: {...}` bytes.
The whole path is the route before the encoder: make_outputs building every tensor at once (the BLS model's
metrics included), the standard outputs chosen, the document written with `dumps(doc, sort_keys=True)`
(stream_events.generate_json). The encoder (stream_events.StreamEncoder) fills its per-stream template from the
response's chunk; make_outputs' tensors are never built. Both are checked byte-identical first. A realistic event: a
delta of a few characters from two new tokens, 40 tokens already sent, request id set, no log probs (the BLS
and tensorrt_llm models and log probs as further rows). Rounds alternate which side goes first; each round
times `--events` events of each side and the medians over rounds are printed in µs per event.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from mmserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from mmserve.entrypoints.triton.http import _generate_json, _sse
from mmserve.entrypoints.triton.models import BLS, ENSEMBLE, TRTLLM
from mmserve.entrypoints.triton.outputs import (
    Chunk,
    _bls_metrics,
    _tensors,
    make_outputs,
    select_outputs,
)
from mmserve.entrypoints.triton.stream_events import StreamEncoder, generate_json

REQUEST_ID = "chatcmpl-7f3a9c2e"
CASES = (  # (model, log probs)
    (ENSEMBLE, False),
    (BLS, False),
    (TRTLLM, False),
    (ENSEMBLE, True),
)


def _chunk(model: str, log_probs: bool) -> Chunk:
    ids = list(range(1000, 1042))
    entries = [{t: Logprob(-0.01 * (t % 97))} for t in ids]
    text = "The picture shows a red bus parked on a street corner, with"
    comp = CompletionOutput(0, text, ids, -8.25, entries)
    out = RequestOutput("r", "p", list(range(620)), [comp], False)
    return Chunk("" if model == TRTLLM else " with", out, 40, log_probs)


def _eager_outputs(chunks: list[Chunk], model: str) -> dict:
    """make_outputs as it was before its tensors were built on first read."""
    tensors = _tensors(chunks, model)
    if model == BLS:
        tensors.update(_bls_metrics(chunks, 16))
    return tensors


def _whole(model: str, chunk: Chunk) -> Callable[[], bytes]:
    def one() -> bytes:
        tensors = select_outputs(_eager_outputs([chunk], model), None, model)
        return _sse(generate_json(model, REQUEST_ID, tensors))

    return one


def _encoder(model: str, chunk: Chunk) -> Callable[[], bytes]:
    encoder = StreamEncoder(model, REQUEST_ID)

    def one() -> bytes:
        return _sse(_generate_json(model, REQUEST_ID, make_outputs([chunk], model, 16), encoder))

    return one


def _us_per_event(fn: Callable[[], bytes], events: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(events):
        fn()
    return (time.perf_counter_ns() - start) / events / 1e3


def compare(model: str, log_probs: bool, rounds: int, events: int) -> tuple[float, float]:
    """Median µs per event over interleaved rounds: (whole path, encoder)."""
    chunk = _chunk(model, log_probs)
    whole, encoder = _whole(model, chunk), _encoder(model, chunk)
    if whole() != encoder():
        raise AssertionError(f"{model}: the encoder's event differs from the whole path's")
    times: dict[str, list[float]] = {"whole": [], "encoder": []}
    for r in range(rounds):
        sides = [("whole", whole), ("encoder", encoder)]
        for name, fn in sides if r % 2 == 0 else reversed(sides):
            times[name].append(_us_per_event(fn, events))
    return statistics.median(times["whole"]), statistics.median(times["encoder"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--events", type=int, default=200, help="events per side per round")
    args = parser.parse_args()
    print(f"{'model':<18} {'log probs':<10} {'whole µs':>9} {'encoder µs':>11} {'ratio':>6}")
    for model, log_probs in CASES:
        whole, encoder = compare(model, log_probs, args.rounds, args.events)
        print(f"{model:<18} {log_probs!s:<10} {whole:9.2f} {encoder:11.2f} {whole / encoder:6.1f}")
    print(f"event: {_whole(ENSEMBLE, _chunk(ENSEMBLE, False))()!r}")


if __name__ == "__main__":
    main()
