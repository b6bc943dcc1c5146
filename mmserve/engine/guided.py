"""Guided decoding: outputs constrained to a JSON schema, any JSON, a regular expression or an EBNF grammar.

`GrammarCache` compiles a request's guide once per (type, guide) with xgrammar against the model's tokenizer and
vocabulary, and hands each request its own matcher (its position in the grammar). Before every sampling step the
sampler masks the ids the matcher does not allow (`SamplingBatch`, from `fill_next_token_bitmask`); the engine
feeds each sampled token back (`accept_token`). The guide types are TensorRT-LLM's `guided_decoding_guide_type`
values: `json` (any JSON object or array; no guide), `json_schema`, `regex`, `ebnf_grammar` (GBNF).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict


class GrammarCache:
    """Compiled grammars of one tokenizer and vocabulary, least recently used dropped past `capacity`."""

    def __init__(
        self, tokenizer, vocab_size: int, stop_token_ids: list[int], capacity: int = 64
    ) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.capacity = capacity
        self._compiler = (
            None  # built on first use: importing xgrammar and reading the vocabulary take time
        )
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = (
            threading.Lock()
        )  # preprocessing threads and the engine thread may both compile

    def guide(self, guide_type: str, guide: str | None) -> "Guide":
        """A fresh Guide (matcher) for a request; ValueError naming the field when the guide does not compile."""
        import xgrammar as xgr

        return Guide(xgr.GrammarMatcher(self.compile(guide_type, guide)), self.vocab_size)

    def compile(self, guide_type: str, guide: str | None):
        """The guide's compiled grammar (cached); guide_type is one of GUIDE_TYPES (SamplingParams checks it)."""
        key = (guide_type, guide or "")
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compile(guide_type, guide)
                self._compiled[key] = compiled
                while len(self._compiled) > self.capacity:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        return compiled

    def _compile(self, guide_type: str, guide: str | None):
        import xgrammar as xgr

        if self._compiler is None:
            try:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
            except Exception as e:  # noqa: BLE001 - xgrammar's own types
                raise ValueError(
                    f"guided_decoding_guide_type: guided decoding is not available for this model's "
                    f"tokenizer ({e})"
                ) from None
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            if guide_type == "json":
                return self._compiler.compile_builtin_json_grammar()
            if guide_type == "json_schema":
                json.loads(guide)  # a clear message for text that is not JSON at all
                return self._compiler.compile_json_schema(guide, any_whitespace=False)
            if guide_type == "regex":
                return self._compiler.compile_regex(guide)
            return self._compiler.compile_grammar(guide)
        except Exception as e:  # noqa: BLE001 - xgrammar raises its own types for bad guides
            raise ValueError(
                f"guided_decoding_guide: not a valid {guide_type} guide: {e}"
            ) from None


class Guide:
    """One request's position in its grammar: the ids it allows next (as bits), and the tokens it took."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: one bit per id of the vocabulary."""
        return (self.vocab_size + 31) // 32

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        """Write the ids allowed next into row `row` of an int32 [rows, bitmask_words] CPU tensor."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)
