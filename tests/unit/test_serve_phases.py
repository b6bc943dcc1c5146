"""Phase times of served requests: PhaseTimes' durations, the histogram Metrics renders, and bench/serve_phases'
reading of two scrapes (mean and estimated quantile per phase)."""

from __future__ import annotations

import math

from mmserve.bench.serve_phases import parse_phases, phase_breakdown, phase_quantiles
from mmserve.core.outputs import PHASE_EVENTS, PHASES, PhaseTimes
from mmserve.entrypoints.metrics import Metrics


def times_of(gaps_ms: list[float], start: float = 100.0) -> PhaseTimes:
    """A PhaseTimes whose phases take `gaps_ms` in PHASES order."""
    times, t = PhaseTimes(), start
    times.mark(PHASE_EVENTS[0], t)
    for event, gap in zip(PHASE_EVENTS[1:], gaps_ms):
        t += gap / 1000
        times.mark(event, t)
    return times


def test_durations_are_the_gaps_between_events_and_the_first_mark_stays():
    times = times_of([1, 2, 3, 4, 5, 6])
    times.mark("handed", 1e9)  # a second engine request of the same call gets there later: ignored
    got = times.durations()
    assert list(got) == list(PHASES)
    assert [round(v * 1000, 6) for v in got.values()] == [1, 2, 3, 4, 5, 6]


def test_durations_wait_for_every_event():
    times = times_of([1, 2, 3, 4, 5, 6])
    del times.stamps["scheduled"]
    assert times.durations() is None
    assert not times.reached("scheduled") and times.reached("first_byte")


def _scrape(metrics: Metrics) -> dict:
    return parse_phases(metrics.render().decode())


def test_breakdown_is_the_mean_over_the_requests_between_two_scrapes():
    metrics = Metrics(lambda: {}, model_name="m")
    metrics.observe_phases(
        times_of([50, 50, 50, 50, 50, 50])
    )  # before the first scrape: not counted
    before = _scrape(metrics)
    metrics.observe_phases(times_of([1, 2, 3, 4, 5, 6]))
    metrics.observe_phases(times_of([3, 4, 5, 6, 7, 8]))
    incomplete = times_of([9, 9, 9, 9, 9, 9])
    del incomplete.stamps["first_byte"]
    metrics.observe_phases(incomplete)  # never reached its first bytes: nothing recorded
    after = _scrape(metrics)
    assert {p: after[p]["count"] for p in PHASES} == {p: 3.0 for p in PHASES}
    mean = phase_breakdown(before, after)
    assert list(mean) == list(PHASES)
    for got, want in zip(mean.values(), [2, 3, 4, 5, 6, 7]):
        assert math.isclose(got, want, rel_tol=1e-9)


def test_quantile_lies_in_the_bucket_that_holds_it():
    metrics = Metrics(lambda: {}, model_name="m")
    before = _scrape(metrics)
    for ms in (0.15, 0.15, 0.15, 30.0):  # buckets 0.1-0.2 ms and 20-50 ms
        metrics.observe_phases(times_of([ms] * 6))
    after = _scrape(metrics)
    p50 = phase_quantiles(before, after, 0.5)
    p99 = phase_quantiles(before, after, 0.99)
    for phase in PHASES:
        assert 0.1 < p50[phase] <= 0.2
        assert 20.0 < p99[phase] <= 50.0


def test_phases_no_request_reached_are_nan():
    metrics = Metrics(lambda: {}, model_name="m")
    before = after = _scrape(metrics)
    assert all(math.isnan(v) for v in phase_breakdown(before, after).values())
    assert all(math.isnan(v) for v in phase_quantiles({}, after).values())
