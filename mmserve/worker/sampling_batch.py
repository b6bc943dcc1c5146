"""SamplingBatch: one step's sampling tensors for B rows, built on the host from each row's SamplingParams,
prompt and output ids, bad words and grammar; a tensor only where some row needs it. Also the fused
sampler's per-row Philox seeds (`row_seed`). worker/sampler.py applies them, in the order its docstring gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mmserve.core.stop_matcher import TokenSequenceMatcher
from mmserve.core.transfer import to_device
from mmserve.sampling_params import SamplingParams

_TEMP_EPS = (
    1e-5  # temperatures below this are treated as greedy: logits / 1e-30 would overflow fp32
)
_MASK64 = (1 << 64) - 1
# the per-row tensors a batch of plain greedy rows leaves out
_OPTIONAL_ROWS = (
    "greedy",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "mask_rows",
    "mask_ids",
    "bias_rows",
    "bias_ids",
    "bias_values",
    "guided_rows",
    "guided_bitmask",
    "prompt_ids",
    "output_ids",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _mix64(x: int) -> int:
    """splitmix64's finalizer: spreads nearby integers (a seed and its next output position) far apart."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: fits int64


def row_seed(seed: int, position: int) -> int:
    """The fused sampler's Philox seed for a seeded request's draw of output token `position`."""
    return _mix64(_mix64(seed & _MASK64) ^ position)


def _pad(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Ragged id lists -> [B, L] int64 padded with -1 (an id outside [0, V) that the penalties ignore)."""
    width = max((len(r) for r in rows), default=0)
    return to_device([r + [-1] * (width - len(r)) for r in rows], torch.int64, device)


@dataclass
class SamplingBatch:
    """Per-step sampling tensors for B rows. Optional tensors are None when no row needs them."""

    num_rows: int
    vocab_size: int
    device: torch.device
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool; None when no row is greedy
    temperature: torch.Tensor | None  # [B] fp32 (1.0 on greedy rows); None when all are 1 / greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = off
    max_top_k: int  # largest active top_k (0 if none)
    top_p: torch.Tensor | None  # [B] fp32
    min_p: torch.Tensor | None  # [B] fp32
    mask_rows: torch.Tensor | None  # [M] int64: (row, id) pairs set to -inf (bad words, min_tokens)
    mask_ids: torch.Tensor | None  # [M] int64
    bias_rows: torch.Tensor | None  # [N] int64: (row, id, value) of each logit bias
    bias_ids: torch.Tensor | None  # [N] int64
    bias_values: torch.Tensor | None  # [N] fp32
    guided_rows: torch.Tensor | None  # [G] int64 rows under a grammar
    guided_bitmask: (
        torch.Tensor | None
    )  # [G, ceil(V' / 32)] int32, bit j of word w allows id 32 w + j
    prompt_ids: (
        torch.Tensor | None
    )  # [B, Lp] int64 padded with -1 (only rows with repetition penalty)
    output_ids: torch.Tensor | None  # [B, Lo] int64 padded with -1 (only rows with a penalty)
    repetition_penalty: torch.Tensor | None  # [B] fp32
    presence_penalty: torch.Tensor | None  # [B] fp32
    frequency_penalty: torch.Tensor | None  # [B] fp32
    seeded: list[tuple[int, torch.Generator]] = field(
        default_factory=list
    )  # sampling rows with their own RNG
    any_unseeded: bool = False  # some sampling row draws from the global RNG
    seeds: torch.Tensor | None = (
        None  # [B] int64 Philox seeds of the fused sampler (CUDA, not all greedy)
    )
    max_num_logprobs: int | None = None  # K = max requested logprobs; None = nobody asked

    @property
    def has_penalties(self) -> bool:
        return self.output_ids is not None

    @classmethod
    def plain(cls, num_rows: int, vocab_size: int, device: torch.device) -> "SamplingBatch":
        """num_rows rows that all take the argmax of their logits as they are (plain_greedy: the common batch)."""
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            device=torch.device(device),
            all_greedy=True,
            **dict.fromkeys(_OPTIONAL_ROWS),
            max_top_k=0,
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        eos_token_ids: list[tuple[int, ...] | int | None],
        bad_words_ids: list[TokenSequenceMatcher | list[list[int]] | None],
        vocab_size: int,
        device: torch.device,
        grammars: list | None = None,
    ) -> "SamplingBatch":
        """eos_token_ids[i]: the row's EOS ids (an int: one; empty or None fall back to params.eos_token_id);
        bad_words_ids[i]: the row's bad words, each already tokenized: the request's TokenSequenceMatcher (it has
        taken the row's output ids already: Request.fill_pending), or a list of id lists matched here against
        output_token_ids[i]; generators[i] is used only when
        params[i].seed is set; grammars[i]: the row's guided-decoding Guide (engine/guided.py) or None."""
        device = torch.device(device)
        num_rows = len(params)
        guided = [(i, g) for i, g in enumerate(grammars or []) if g is not None]
        plain = all(
            plain_greedy(p, out, bad)
            for p, out, bad in zip(params, output_token_ids, bad_words_ids)
        )
        if plain and not guided:
            return cls.plain(num_rows, vocab_size, device)
        greedy = [_is_greedy(p) for p in params]
        all_greedy = all(greedy)

        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_k = [0 if g or not p.top_k_active else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]

        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for i, p in enumerate(params):
            out = output_token_ids[i]
            banned = set(_bad_word_bans(bad_words_ids[i], out))
            if len(out) < p.min_tokens:
                eos = eos_token_ids[i] if eos_token_ids[i] not in (None, ()) else p.eos_token_id
                if eos is not None and not p.ignore_eos:
                    banned.update((eos,) if isinstance(eos, int) else eos)
                banned.update(p.stop_token_ids)
            for tok in sorted(banned):
                if 0 <= tok < vocab_size:
                    mask_rows.append(i)
                    mask_ids.append(tok)

        bias = [
            (i, tok, float(v))
            for i, p in enumerate(params)
            for tok, v in sorted(p.logit_bias.items())
            if 0 <= tok < vocab_size
        ]

        bitmask = None
        if guided:  # the matchers write their allowed ids as bits, on the host
            bitmask = torch.zeros(len(guided), guided[0][1].bitmask_words, dtype=torch.int32)
            for j, (_, matcher) in enumerate(guided):
                matcher.fill_next_token_bitmask(bitmask, j)

        rep = [float(p.repetition_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]
        freq = [float(p.frequency_penalty) for p in params]
        any_rep = any(r != 1.0 for r in rep)
        any_pres = any(x != 0.0 for x in pres)
        any_freq = any(x != 0.0 for x in freq)
        penalised = [r != 1.0 or a != 0.0 or b != 0.0 for r, a, b in zip(rep, pres, freq)]

        seeded = [
            (i, generators[i])
            for i, p in enumerate(params)
            if not greedy[i] and p.seed is not None and generators[i] is not None
        ]
        seeded_rows = {i for i, _ in seeded}
        any_unseeded = any(not greedy[i] and i not in seeded_rows for i in range(num_rows))

        requested = [p.logprobs for p in params if p.logprobs is not None]
        seeds = None  # only the fused sampler (CUDA) draws from them
        if device.type == "cuda" and not all_greedy:
            base = int(
                torch.empty((), dtype=torch.int64).random_(1 << 62)
            )  # global RNG, like the torch path
            if any(p.seed is not None and not g for p, g in zip(params, greedy)):
                seeds = to_device(
                    [
                        row_seed(p.seed, len(out)) if p.seed is not None else base + i
                        for i, (p, out) in enumerate(zip(params, output_token_ids))
                    ],
                    torch.int64,
                    device,
                )
            else:
                seeds = torch.arange(base, base + num_rows, dtype=torch.int64, device=device)
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            device=device,
            all_greedy=all_greedy,
            greedy=to_device(greedy, torch.bool, device)
            if any(greedy) and not all_greedy
            else None,
            temperature=None
            if all(t == 1.0 for t in temps)
            else to_device(temps, torch.float32, device),
            top_k=to_device(top_k, torch.int64, device) if any(top_k) else None,
            max_top_k=max(top_k, default=0),
            top_p=to_device(top_p, torch.float32, device) if any(x < 1.0 for x in top_p) else None,
            min_p=to_device(min_p, torch.float32, device) if any(x > 0.0 for x in min_p) else None,
            mask_rows=to_device(mask_rows, torch.int64, device) if mask_rows else None,
            mask_ids=to_device(mask_ids, torch.int64, device) if mask_ids else None,
            bias_rows=to_device([b[0] for b in bias], torch.int64, device) if bias else None,
            bias_ids=to_device([b[1] for b in bias], torch.int64, device) if bias else None,
            bias_values=to_device([b[2] for b in bias], torch.float32, device) if bias else None,
            guided_rows=to_device([i for i, _ in guided], torch.int64, device) if guided else None,
            guided_bitmask=to_device(bitmask, torch.int32, device) if bitmask is not None else None,
            prompt_ids=_pad(
                [list(prompt_token_ids[i]) if rep[i] != 1.0 else [] for i in range(num_rows)],
                device,
            )
            if any_rep
            else None,
            output_ids=_pad(
                [list(output_token_ids[i]) if penalised[i] else [] for i in range(num_rows)], device
            )
            if any(penalised)
            else None,
            repetition_penalty=to_device(rep, torch.float32, device) if any_rep else None,
            presence_penalty=to_device(pres, torch.float32, device) if any_pres else None,
            frequency_penalty=to_device(freq, torch.float32, device) if any_freq else None,
            seeded=seeded,
            any_unseeded=any_unseeded,
            seeds=seeds,
            max_num_logprobs=max(requested) if requested else None,
        )


def _bad_word_bans(
    bad: TokenSequenceMatcher | list[list[int]] | None, out: list[int]
) -> frozenset[int]:
    """The ids a bad word would complete if sampled next."""
    if not bad:
        return frozenset()
    if not isinstance(bad, TokenSequenceMatcher):
        bad = TokenSequenceMatcher(bad).feed_all(out)
    return bad.banned_next()


def _is_greedy(p: SamplingParams) -> bool:
    return p.greedy or p.temperature < _TEMP_EPS


def plain_greedy_from(
    p: SamplingParams, bad_words: TokenSequenceMatcher | list[list[int]] | None
) -> float:
    """The output length from which a row of these params and bad words takes the argmax of its logits as they
    are (plain_greedy): its min_tokens, or inf when it never does (it samples, has penalties, a logit bias, bad words
    or logprobs). Fixed for a request, which keeps it (Request.plain_sampling_from)."""
    plain = (
        _is_greedy(p)
        and not bad_words
        and not p.logit_bias
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.logprobs is None
    )
    return p.min_tokens if plain else math.inf


def plain_greedy(
    p: SamplingParams,
    output_token_ids: list[int],
    bad_words: TokenSequenceMatcher | list[list[int]] | None,
) -> bool:
    """A row that takes the argmax of its logits as they are: greedy, no penalty, no id to mask, no logprobs (the
    common batch, which SamplingBatch.build then makes without its per-row lists)."""
    return len(output_token_ids) >= plain_greedy_from(p, bad_words)
