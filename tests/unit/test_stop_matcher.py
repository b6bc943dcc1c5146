"""core/stop_matcher.py against brute-force references on random texts and patterns (overlapping ones, patterns
that are prefixes or suffixes of others, repeats), and RequestLimits' checks."""

from __future__ import annotations

import random

import pytest

from mmserve.core.stop_matcher import Automaton, StopStringMatcher, TokenSequenceMatcher
from mmserve.sampling_params import RequestLimits, SamplingParams


def _patterns(rng: random.Random, alphabet: str, count: int) -> list[str]:
    pats = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(count)]
    pats += [
        p[: rng.randint(1, len(p))] for p in rng.sample(pats, min(2, len(pats)))
    ]  # prefixes of others
    pats += [
        p[rng.randint(0, len(p) - 1) :] for p in rng.sample(pats, min(2, len(pats)))
    ]  # suffixes of others
    pats.append(rng.choice(pats))  # a repeat
    rng.shuffle(pats)
    return pats


def _pending(text: str, pats: list[str]) -> int:
    """Longest suffix of text that is a prefix of some pattern (brute force)."""
    return max(
        (n for n in range(len(text) + 1) for p in pats if text.endswith(p[:n]) and n <= len(p)),
        default=0,
    )


def _longest_ending(text: str, pats: list[str]) -> str | None:
    ending = [p for p in pats if text.endswith(p)]
    return max(ending, key=len) if ending else None


def _first_stop(text: str, pats: list[str]) -> tuple[str, int] | None:
    """(stop, end) of the match that ends first, the longest of those (the detokenizer's rule, by str.find)."""
    best = None
    for p in pats:
        pos = text.find(p)
        if pos >= 0 and (best is None or (pos + len(p), -len(p)) < (best[1], -len(best[0]))):
            best = (p, pos + len(p))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_automaton_states_match_brute_force(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    pats = _patterns(rng, alphabet, rng.randint(1, 6))
    auto = Automaton(pats)
    text, state = "", 0
    for _ in range(60):
        ch = rng.choice(alphabet)
        text += ch
        state = auto.step(state, ch)
        assert auto.depth[state] == _pending(text, pats)
        m = auto.match[state]
        assert (auto.patterns[m] if m >= 0 else None) == _longest_ending(text, pats)
        # bad words: p[-1] is banned next when p[:-1] is a suffix of the text
        banned = {p[-1] for p in pats if text.endswith(p[:-1])}
        assert auto.completions(state) == banned


@pytest.mark.parametrize("seed", range(40))
def test_stop_strings_fed_in_random_pieces(seed):
    """The first stop string (earliest end, then longest) and the hold-back, whatever the text's pieces."""
    rng = random.Random(100 + seed)
    alphabet = "ab" if seed % 2 else "abcd"
    pats = _patterns(rng, alphabet, rng.randint(1, 8))
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    want = _first_stop(text, pats)
    matcher = StopStringMatcher(pats)
    fed, got = 0, None
    while fed < len(text) and got is None:
        piece = text[fed : fed + rng.randint(1, 6)]
        hit = matcher.feed(piece)
        if hit is not None:
            got = (hit[0], fed + hit[1])
        else:
            fed += len(piece)
            # no stop ends in text[:fed]: the hold-back is the longest suffix that is a (proper) prefix of one
            assert matcher.pending == _pending(text[:fed], pats) < max(map(len, pats))
    assert got == want


def test_stop_string_ties_and_overlaps():
    m = StopStringMatcher(["bcd", "abcd", "c"])  # "c" ends first
    assert m.feed("xabcd") == ("c", 4)
    m = StopStringMatcher(["bcd", "abcd"])  # same end: the longer
    assert m.feed("xab") is None and m.pending == 2
    assert m.feed("cd") == ("abcd", 2)
    m = StopStringMatcher(["aab"])
    assert m.feed("aaaa") is None and m.pending == 2
    assert m.feed("c") is None and m.pending == 0


@pytest.mark.parametrize("seed", range(40))
def test_token_sequences_match_brute_force(seed):
    rng = random.Random(200 + seed)
    seqs = [[rng.randint(0, 3) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 6))]
    seqs.append(seqs[0][:1])
    matcher = TokenSequenceMatcher(seqs)
    assert matcher.longest == max(map(len, seqs))
    out: list[int] = []
    for _ in range(50):
        banned = {
            s[-1] for s in seqs if len(s) - 1 <= len(out) and out[len(out) - len(s) + 1 :] == s[:-1]
        }
        assert matcher.banned_next() == banned
        tok = rng.randint(0, 3)
        out.append(tok)
        ended = matcher.feed(tok)
        assert (
            ended == matcher.ended == any(out[-len(s) :] == s for s in seqs if len(s) <= len(out))
        )


def test_empty_lists_and_patterns():
    assert not TokenSequenceMatcher([]) and not TokenSequenceMatcher([[]])
    assert TokenSequenceMatcher([[]]).banned_next() == frozenset()
    m = StopStringMatcher(["", "x"])
    assert m.feed("ax") == ("x", 2)


def test_request_limits_name_the_list_the_count_and_the_flag():
    limits = RequestLimits(max_stop_sequences=3, max_stop_sequence_chars=10)
    limits.check(
        SamplingParams(
            stop=["a"] * 3, bad_words=["abcde", "fghij"], stop_token_sequences=[[1] * 10]
        )
    )
    cases = [
        (dict(stop=["a"] * 4), "stop: 4 entries, more than --max-stop-sequences=3"),
        (
            dict(stop=["abcdef", "ghijk"]),
            "stop: 11 characters in all, more than --max-stop-sequence-chars=10",
        ),
        (dict(bad_words=["x"] * 5), "bad_words: 5 entries, more than --max-stop-sequences=3"),
        (
            dict(stop_token_ids=[1, 2, 3, 4]),
            "stop_token_ids: 4 entries, more than --max-stop-sequences=3",
        ),
        (
            dict(stop_token_sequences=[[1] * 11]),
            "stop_token_sequences: 11 token ids in all, more than --max-stop-sequence-chars=10",
        ),
        (
            dict(bad_token_sequences=[[1]] * 4),
            "bad_token_sequences: 4 entries, more than --max-stop-sequences=3",
        ),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError) as err:
            limits.check(SamplingParams(**kw))
        assert str(err.value) == message
    with pytest.raises(ValueError, match="max_stop_sequences must be an integer >= 1"):
        RequestLimits(max_stop_sequences=0)
