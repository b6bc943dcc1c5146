"""SamplingParams: how one request is decoded. All validation of user-given values lives here."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
MAX_N = 64  # sequences per prompt (SamplingParams.n)
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SEED_MAX = 2**64 - 1 - MAX_N  # Triton's random_seed is a UINT64


@dataclass
class SamplingParams:
    """Decoding settings of one request.

    Bad values raise ValueError naming the field, so every frontend gets the same checks.
    """

    # sequences per prompt: LLM.generate and the servers run n > 1 as n engine requests (choice_params); the
    # engine itself takes n = 1
    n: int = 1
    max_tokens: int = 16  # new tokens at most
    min_tokens: int = 0  # EOS / stop ids are masked until this many tokens
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # per-request generator; None = engine's global RNG
    repetition_penalty: float = 1.0  # > 0; 1 = off (divides positive logits, multiplies negative)
    presence_penalty: float = 0.0  # subtracted once per token id already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    eos_token_id: int | None = None  # overrides the tokenizer's EOS (Triton `end_id`)
    ignore_eos: bool = False
    bad_words: list[str] = field(default_factory=list)  # token sequences never generated
    # already tokenized (Triton's token-level `tensorrt_llm` model): the output stops once it ends with one of
    # stop_token_sequences (the tokens stay in it), and never contains one of bad_token_sequences
    stop_token_sequences: list[list[int]] = field(default_factory=list)
    bad_token_sequences: list[list[int]] = field(default_factory=list)
    # token id -> value added to its logit before everything else (OpenAI `logit_bias`, Triton `embedding_bias_*`)
    logit_bias: dict[int, float] = field(default_factory=dict)
    # the output follows this guide (engine/guided.py): json | json_schema | regex | ebnf_grammar, None = free
    guided_decoding_type: str | None = None
    guided_decoding_guide: str | None = None  # the schema / regex / grammar (none for "json")
    # ids the guide has taken already, before this request's output (beam search's one-token step requests:
    # the beam's tokens, which sit in their prompts)
    guided_decoding_prefix: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None = off; k >= 0: chosen token's + top-k logprobs
    # None = off; k >= 0: each prompt token's logprob given the tokens before it, + the top k (the first has none)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    return_context_logits: bool = False  # fp32 logits of every prompt position, on the final output
    return_generation_logits: bool = (
        False  # fp32 logits of every generated step, on the final output
    )
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self.stop_token_sequences = [list(t) for t in self.stop_token_sequences or []]
        self.bad_token_sequences = [list(t) for t in self.bad_token_sequences or []]
        self.logit_bias = dict(self.logit_bias or {})
        self.guided_decoding_prefix = list(self.guided_decoding_prefix or [])
        self._check()

    def _check(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            fail("n", f"must be an integer in [1, {MAX_N}]")
        for f in dataclasses.fields(
            self
        ):  # NaN passes every comparison below, so finiteness comes first
            value = getattr(self, f.name)
            if f.type == "float" and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                fail(f.name, "must be a finite number")
            if (
                f.type in ("int", "int | None")
                and f.name != "seed"
                and isinstance(value, int)
                and not _INT64_MIN <= value <= _INT64_MAX
            ):
                fail(f.name, "must fit in 64 bits")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", "must be an integer in [0, max_tokens]")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= _INT32_MAX:
            fail("top_k", f"must be an integer in [-1, {_INT32_MAX}] (-1 or 0 disable it)")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 20
            ):
                fail(name, "must be an integer in [0, 20]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not _INT64_MIN <= self.seed <= _SEED_MAX
        ):
            fail(
                "seed",
                f"must be an integer in [{_INT64_MIN}, {_SEED_MAX}] (a 64-bit generator seed; sequence i of "
                "a prompt draws from seed + i)",
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be non-negative integers")
        for name in ("stop_token_sequences", "bad_token_sequences"):
            if any(
                not seq or any(not isinstance(t, int) or t < 0 for t in seq)
                for seq in getattr(self, name)
            ):
                fail(name, "must be non-empty lists of non-negative token ids")
        if self.eos_token_id is not None and (
            not isinstance(self.eos_token_id, int) or self.eos_token_id < 0
        ):
            fail("eos_token_id", "must be a non-negative integer")
        if self.guided_decoding_type is not None and self.guided_decoding_type not in GUIDE_TYPES:
            fail("guided_decoding_type", f"must be one of {', '.join(GUIDE_TYPES)}")
        if self.guided_decoding_type not in (None, "json") and not self.guided_decoding_guide:
            fail(
                "guided_decoding_guide",
                f"must be given for guided_decoding_type {self.guided_decoding_type!r}",
            )
        if self.guided_decoding_prefix and (
            self.guided_decoding_type is None
            or any(not isinstance(t, int) or t < 0 for t in self.guided_decoding_prefix)
        ):
            fail(
                "guided_decoding_prefix",
                "must be non-negative token ids, with a guided_decoding_type",
            )
        for tok, bias in self.logit_bias.items():
            if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                fail("logit_bias", "must map non-negative integer token ids to biases")
            if (
                not isinstance(bias, (int, float))
                or isinstance(bias, bool)
                or not math.isfinite(bias)
            ):
                fail("logit_bias", "must map token ids to finite numbers")

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether every prompt position's logits must be computed (no prefix-cache or prompt-end shortcut)."""
        return self.return_context_logits or self.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Per-sequence copies of `params` (n = 1 each) for n sequences of one prompt (SamplingParams.n, OpenAI `n`,
    Triton `num_return_sequences`): with a seed, sequence i draws from seed + i (distinct and reproducible: it
    equals a one-sequence request with that seed); without one, n independent samples."""
    if params.seed is None:
        return [dataclasses.replace(params, n=1) for _ in range(n)]
    return [dataclasses.replace(params, n=1, seed=params.seed + i) for i in range(n)]


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on the lists a client can grow in one request (stop strings, stop ids, token sequences, bad words),
    whose size the engine pays for: tokenizing bad words and building each list's matcher once per request
    (core/stop_matcher.py; matching itself then costs the same per token whatever the lists hold). Per list, at
    most `max_stop_sequences` entries and `max_stop_sequence_chars` characters (strings) or token ids (token
    sequences) in all. The engine checks them before a request is queued (`Engine.add_processed`, beam search's
    `beam_search_steps`); `mmserve serve --max-stop-sequences / --max-stop-sequence-chars`, `LLM(max_stop_sequences=,
    max_stop_sequence_chars=)`. logit_bias needs no bound here: its keys are distinct ids of the vocabulary (the
    engine checks them), and Triton's embedding_bias is one value per vocabulary id by design."""

    max_stop_sequences: int = 64
    max_stop_sequence_chars: int = 4096

    # the lists, and what their entries' lengths count (None: one id each, only the entries are bounded)
    LISTS = (
        ("stop", "characters"),
        ("bad_words", "characters"),
        ("stop_token_ids", None),
        ("stop_token_sequences", "token ids"),
        ("bad_token_sequences", "token ids"),
    )

    def __post_init__(self) -> None:
        for name in ("max_stop_sequences", "max_stop_sequence_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def check(self, params: SamplingParams) -> None:
        """ValueError naming the first list over a bound, what it holds and the bound with its flag."""
        for name, unit in self.LISTS:
            values = getattr(params, name)
            if len(values) > self.max_stop_sequences:
                raise ValueError(
                    f"{name}: {len(values)} entries, more than --max-stop-sequences="
                    f"{self.max_stop_sequences}"
                )
            if unit is not None and (total := sum(map(len, values))) > self.max_stop_sequence_chars:
                raise ValueError(
                    f"{name}: {total} {unit} in all, more than --max-stop-sequence-chars="
                    f"{self.max_stop_sequence_chars}"
                )
