"""Stop strings, stop token sequences and bad token sequences matched with one Aho-Corasick automaton per list.

A request's lists are built into an automaton once (`Automaton`: a trie of the patterns with failure links), and
its output is fed through it as it grows, one symbol at a time: characters of the decoded text for stop strings
(`StopStringMatcher`), token ids for token sequences (`TokenSequenceMatcher`). The walk costs amortised O(1) per
symbol however many patterns there are and however long (the state's depth grows by at most one per symbol, and
each failure link taken shortens it), where checking every pattern at every token costs their number times
their length.

What the state answers:
- its depth is the longest suffix of the text so far that is a prefix of some pattern: the detokenizer's
  hold-back (text that may still become a stop string);
- a pattern ends at the last symbol when the state or a state on its failure chain spells one (`Automaton.match`:
  the longest such pattern, precomputed per state);
- the tokens that would complete a pattern next (bad token sequences) are the children of the state and of its
  failure chain that end a pattern (`Automaton.completions`, precomputed per state on first use).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence


class Automaton:
    """Aho-Corasick automaton over `patterns`, sequences of hashable symbols (strings, or lists of token ids).

    States are ints, 0 the root (the empty prefix); empty patterns are ignored. `depth[s]` is the length of state
    s's prefix, `ends[s]` the index in `patterns` of the pattern it spells (-1: none) and `match[s]` that of the
    longest pattern that is a suffix of it (-1: none).
    """

    __slots__ = ("patterns", "goto", "fail", "depth", "ends", "match", "_completions")

    def __init__(self, patterns: Sequence[Sequence[Hashable]]) -> None:
        self.patterns = list(patterns)
        goto: list[dict[Hashable, int]] = [{}]
        depth = [0]
        ends = [-1]  # the pattern the state spells, if any (the first of equal ones)
        for index, pattern in enumerate(self.patterns):
            state = 0
            for symbol in pattern:
                nxt = goto[state].get(symbol)
                if nxt is None:
                    nxt = len(goto)
                    goto[state][symbol] = nxt
                    goto.append({})
                    depth.append(depth[state] + 1)
                    ends.append(-1)
                state = nxt
            if state and ends[state] < 0:
                ends[state] = index
        fail = [0] * len(goto)
        match = [-1] * len(goto)
        queue = deque(
            goto[0].values()
        )  # breadth first: a failure link points to a shallower, finished state
        while queue:
            state = queue.popleft()
            match[state] = ends[state] if ends[state] >= 0 else match[fail[state]]
            for symbol, child in goto[state].items():
                f = fail[state]
                while f and symbol not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(symbol, 0) if state else 0
                queue.append(child)
        self.goto, self.fail, self.depth, self.ends, self.match = goto, fail, depth, ends, match
        self._completions: list[frozenset] | None = None

    def step(self, state: int, symbol: Hashable) -> int:
        """The state after `symbol`: the longest suffix of (state's prefix + symbol) that is a prefix of a pattern."""
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(symbol)
            if nxt is not None:
                return nxt
            if not state:
                return 0
            state = fail[state]

    def completions(self, state: int) -> frozenset:
        """The symbols that, fed next, end a pattern: for each pattern p, p[-1] when p[:-1] is a suffix of the
        state's prefix (always, for one-symbol patterns)."""
        if self._completions is None:
            self._completions = self._build_completions()
        return self._completions[state]

    def _build_completions(self) -> list[frozenset]:
        goto, fail, ends = self.goto, self.fail, self.ends
        out: list[frozenset] = [frozenset()] * len(goto)
        queue = deque([0])  # breadth first, as the failure links
        while queue:
            state = queue.popleft()
            inherited = out[fail[state]] if state else frozenset()
            own = frozenset(symbol for symbol, child in goto[state].items() if ends[child] >= 0)
            out[state] = (
                own | inherited if own else inherited
            )  # states without completions share their link's set
            queue.extend(goto[state].values())
        return out


class StopStringMatcher:
    """A request's stop strings over its decoded text, fed as it grows (IncrementalDetokenizer).

    `feed` reports the first stop string that ends in the new text (the earliest end; of several ending there, the
    longest), so the result does not depend on how the text was split into pieces; `pending` is the length of the
    longest suffix of the text so far that is a proper prefix of a stop string (while nothing has matched).
    """

    __slots__ = ("automaton", "state")

    def __init__(self, stops: Sequence[str]) -> None:
        self.automaton = Automaton([s for s in stops if s])
        self.state = 0

    def feed(self, text: str) -> tuple[str, int] | None:
        """Walk `text`; (stop string, offset in `text` right after it) at the first match, else None. After a
        match the state is that of the text up to the match's end."""
        auto = self.automaton
        goto, fail, match = auto.goto, auto.fail, auto.match
        state = self.state
        for i, ch in enumerate(text):
            while True:  # Automaton.step, inlined: this runs once per generated character
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if not state:
                    break
                state = fail[state]
            if match[state] >= 0:
                self.state = state
                return auto.patterns[match[state]], i + 1
        self.state = state
        return None

    @property
    def pending(self) -> int:
        """Characters at the end of the text that may still start a stop string (hold them back)."""
        return self.automaton.depth[self.state]


class TokenSequenceMatcher:
    """A request's token sequences (stop token sequences, or bad words as token ids) over its output ids, fed one
    id at a time as they become known (`Request.fill_pending`).

    `ended` says whether the ids so far end with one of the sequences; `banned_next()` the ids that would complete
    one if sampled next (bad words: the sampler masks them); `longest` the longest sequence's length (more than 1:
    the next sampling depends on the ids before it).
    """

    __slots__ = ("automaton", "state", "longest")

    def __init__(self, sequences: Iterable[Sequence[int]]) -> None:
        self.automaton = Automaton([list(s) for s in sequences if len(s)])
        self.state = 0
        self.longest = max((len(s) for s in self.automaton.patterns), default=0)

    def feed(self, token: int) -> bool:
        """Take the next output id; whether the output now ends with one of the sequences."""
        self.state = self.automaton.step(self.state, token)
        return self.automaton.match[self.state] >= 0

    def feed_all(self, tokens: Iterable[int]) -> TokenSequenceMatcher:
        for token in tokens:
            self.feed(token)
        return self

    @property
    def ended(self) -> bool:
        return self.automaton.match[self.state] >= 0

    def banned_next(self) -> frozenset[int]:
        return self.automaton.completions(self.state)

    def __bool__(self) -> bool:
        return bool(self.automaton.patterns)
