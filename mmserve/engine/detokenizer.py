"""Incremental detokenization of one sequence, with stop-string detection and streaming-safe hold-back.

`.text` only ever grows (streaming deltas are its growth); text that could still become a stop string or
that ends inside a multi-byte character is held back until it is decided.
"""

from __future__ import annotations

from mmserve.core.stop_matcher import StopStringMatcher
from mmserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decode generated ids one at a time.

    Decoding uses a prefix-offset / read-offset window over the output ids: each step decodes only
    ids[prefix:read] (text already emitted, for context) and ids[prefix:] and emits the difference, once it
    does not end in U+FFFD (i.e. the bytes so far do not end inside a character). The window starts at the
    first output id, not in the prompt, so the result equals tokenizer.decode(output_ids) exactly, including
    for decoders that strip the first leading space (SentencePiece); callers that want the prompt/completion
    boundary space must add it themselves.

    Stop strings: each push's new characters are fed to the request's Aho-Corasick automaton over its stop
    strings (core/stop_matcher.py, built once), so the check costs the same per character however many stop
    strings there are; the match that ends first wins (ties: the longer one), so the result does not depend on
    how the text was split into tokens. `.text` then ends right before it (or right after it with
    include_stop_str_in_output), and further pushes are refused. While no stop has matched, the longest
    suffix of the decoded text that is a proper prefix of some stop string (the automaton's depth) is held back
    from `.text`: e.g. stop="abc", output "xab" -> `.text` == "x", "ab" pending. It is released as soon as a
    later character rules it out, or by flush() at the end of generation (finish by length / EOS).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = (
            prompt_token_ids  # kept for callers; not used as decoding context (see class doc)
        )
        self.params = params
        self.token_ids: list[int] = []
        self._stops = StopStringMatcher(params.stop) if params.stop else None
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text_cache: tuple[int, int, str] | None = None
        self._decoded = ""  # all text decoded so far that is complete (no dangling bytes)
        self._released = 0  # len of self._decoded exposed through .text
        self._stop_match: str | None = None
        self._finished = False
        self._decode_fn = _fast_decode(tokenizer)

    @property
    def text(self) -> str:
        return self._decoded[: self._released]

    @property
    def finished(self) -> bool:
        """True after a stop string matched or flush() ran."""
        return self._finished

    def push(self, token_id: int) -> str:
        """Append one generated id; returns what `.text` grew by ('' while bytes or a stop prefix are pending)."""
        if self._finished:
            raise RuntimeError("push() after a stop string matched or after flush()")
        self.token_ids.append(int(token_id))
        return self._advance(self._decode_step(final=False))

    def extend(self, token_ids: list[int]) -> None:
        """Append ids without decoding them: for a caller that reads `.text` only after flush() and has no stop
        strings (flush() then decodes the whole window at once, the same text as pushing them one by one)."""
        if self._finished or self._stops is not None:
            raise RuntimeError("extend() needs an unfinished detokenizer without stop strings")
        self.token_ids += token_ids

    def check_stop(self) -> str | None:
        """The stop string that matched (`.text` is already truncated accordingly), else None."""
        return self._stop_match

    def flush(self) -> str:
        """End of generation without a stop string: decode dangling bytes and release all held text.

        Returns what `.text` grew by; afterwards `.text` == decode(output_ids) (unless a stop matched here).
        """
        if self._finished:
            return ""
        delta = self._advance(self._decode_step(final=True), final=True)
        self._finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _decode_step(self, final: bool) -> str:
        """New complete text from the window; moves the offsets when some was produced."""
        prefix, read = self._prefix_offset, self._read_offset
        cache = self._prefix_text_cache
        if cache is not None and cache[:2] == (prefix, read):
            prefix_text = cache[2]
        else:
            prefix_text = self._decode(self.token_ids[prefix:read])
            self._prefix_text_cache = (prefix, read, prefix_text)
        full_text = self._decode(self.token_ids[prefix:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = read, len(self.token_ids)
        return full_text[len(prefix_text) :]

    def _advance(self, new_text: str, final: bool = False) -> str:
        """Append decoded text, look for stop strings, release what is decided; returns the released part."""
        before = self._released
        if not new_text and not final:
            return ""
        self._decoded += new_text
        if self._stops is not None and new_text:
            match = self._stops.feed(new_text)
            if match is not None:
                stop, after = match  # `after`: the offset in new_text right after the stop string
                stop_end = len(self._decoded) - len(new_text) + after
                end = stop_end if self.params.include_stop_str_in_output else stop_end - len(stop)
                self._decoded = self._decoded[:end]
                self._released = end
                self._stop_match = stop
                self._finished = True
                return self._decoded[before:]
        hold = 0 if final or self._stops is None else self._stops.pending
        self._released = max(self._released, len(self._decoded) - hold)
        return self._decoded[before : self._released]


def _fast_decode(tokenizer):
    """The Rust tokenizer's own decode when the HF wrapper would only add overhead (no space clean-up),
    else the wrapper's: both give the same text; this runs twice per generated token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    is_rust = type(backend).__module__.split(".")[0] == "tokenizers"
    if is_rust and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode
    return tokenizer.decode
