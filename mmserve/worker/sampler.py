"""Batched token sampling: SamplingBatch (per-step tensors built from SamplingParams) and Sampler.

Order of processing, per step, on fp32 copies of the logits [B, V] (steps 0-4 only for rows that need them):
  0. logit bias: the row's per-id values are added (OpenAI `logit_bias`, Triton `embedding_bias_*`); then guided
     decoding: ids the row's grammar matcher does not allow next get -inf (engine/guided.py);
  1. bad words: a bad word's last id gets -inf when its prefix (all ids but the last) equals the tail of
     the row's output ids (a one-token bad word always applies); the request's TokenSequenceMatcher
     (core/stop_matcher.py, fed its output ids as they arrive) has those ids ready, whatever the list's size;
  2. min_tokens: while len(output) < min_tokens, the row's EOS (unless ignore_eos) and stop_token_ids get -inf;
  3. penalties: repetition (HF: over prompt+output ids, logit>0 -> logit/p else logit*p), then presence and
     frequency (OpenAI: output ids only, logit -= presence*[count>0] + frequency*count);
  4. logprobs: log_softmax of the logits as they stand after 0-3, i.e. BEFORE temperature, top-k, top-p and
     min-p. Reported logprobs therefore describe the model's distribution under the request's hard
     constraints and penalties, and do not depend on the sampling knobs (the same choice as OpenAI's API);
  5. greedy rows (temperature == 0, or < 1e-5 to avoid overflow, or top_k == 1): argmax;
  6. other rows: logits / temperature, top-k, top-p (on the top-k-renormalised distribution), min-p
     (relative to the max prob), then an exact categorical draw by exponential race:
     argmax(probs / q), q ~ Exp(1) i.i.d. Rows with a seed draw q from their own torch.Generator (on the
     logits' device), so a seeded request's draws do not depend on the rest of the batch; others use the
     global RNG.
On CUDA, steps 5-6 are one Triton kernel (kernels/sampling.py: the same filters, a draw by inversion from
Philox noise, no sort; top-k's threshold from torch.topk), and when no row needs steps 1-4 it reads the
logits as they are, without the fp32 copy. Its noise comes from per-row seeds (SamplingBatch.seeds): a seeded
request's from its seed and output position, so its draws do not depend on the batch either; the others' from
one draw of torch's global (CPU) RNG per step.
Columns >= vocab_size (a padded lm_head) are never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.core.stop_matcher import TokenSequenceMatcher
from mmserve.core.transfer import to_device
from mmserve.sampling_params import SamplingParams

_TEMP_EPS = (
    1e-5  # temperatures below this are treated as greedy: logits / 1e-30 would overflow fp32
)
_MASK64 = (1 << 64) - 1


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


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor | None,
    output_ids: torch.Tensor,
    rep: torch.Tensor | None,
    pres: torch.Tensor | None,
    freq: torch.Tensor | None,
) -> torch.Tensor:
    """Apply repetition / presence / frequency penalties in place and return `logits` [B, V] fp32.

    prompt_ids [B, Lp] and output_ids [B, Lo] are int64 padded with any id outside [0, V) (e.g. -1);
    rep / pres / freq are [B] fp32 (1 / 0 / 0 = off) or None when no row uses that penalty.
    """
    num_rows, vocab = logits.shape

    def clean(ids: torch.Tensor) -> torch.Tensor:
        # padding goes to the spare column V, dropped after the scatter
        return torch.where((ids >= 0) & (ids < vocab), ids, vocab)

    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    if output_ids.numel():
        counts.scatter_add_(1, clean(output_ids), torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]  # [B, V] occurrences in the output
    in_output = counts > 0  # [B, V]
    if rep is not None:
        seen = in_output.clone()
        if prompt_ids is not None and prompt_ids.numel():
            in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
            in_prompt.scatter_(1, clean(prompt_ids), True)
            seen |= in_prompt[:, :vocab]
        r = rep.unsqueeze(1)  # [B, 1]
        penalised = torch.where(logits > 0, logits / r, logits * r)
        logits = torch.where(seen, penalised, logits)
    if freq is not None:
        logits -= freq.unsqueeze(1) * counts
    if pres is not None:
        logits -= pres.unsqueeze(1) * in_output.to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Mask `logits` [B, V] with -inf outside each row's top-k / top-p / min-p set; returns the result.

    top_k [B] int64 (<= 0 or >= V: off), top_p [B] fp32 (1: off), min_p [B] fp32 (0: off); None = off for
    all rows. Top-p keeps the smallest set of most likely tokens whose cumulative prob (after top-k) is
    >= top_p, always including the top token. Min-p drops tokens with prob < min_p * max prob. Tokens tied
    with the k-th largest logit are all kept. max_top_k (the largest active k, known on the host) spares a
    device sync on the top-k-only path. May modify `logits` in place.
    """
    from mmserve.kernels.sampling import (
        kth_largest,
        top_k_active,
    )  # torch only; shared with the fused sampler

    vocab = logits.shape[-1]
    if top_p is not None:
        # one sort serves both top-k and top-p
        srt, order = logits.sort(dim=-1, descending=True)  # [B, V] each
        if top_k is not None:
            k = torch.where(top_k_active(top_k, vocab), top_k, vocab).unsqueeze(1)  # [B, 1]
            kth = srt.gather(1, k - 1)  # [B, 1]
            srt.masked_fill_(srt < kth, float("-inf"))
        probs = srt.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # [B, V] mass strictly above each position
        p = top_p.unsqueeze(1)  # [B, 1]
        srt.masked_fill_((before >= p) & (p < 1.0), float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, srt)
    elif top_k is not None:
        kth = kth_largest(logits, top_k, max_top_k).unsqueeze(1)  # [B, 1]
        logits = logits.masked_fill_(logits < kth, float("-inf"))
    if min_p is not None:
        # prob_i < min_p * max_prob  <=>  logit_i < max_logit + log(min_p); log(0) = -inf masks nothing
        floor = logits.amax(dim=-1, keepdim=True) + min_p.unsqueeze(1).log()  # [B, 1]
        logits = logits.masked_fill_(logits < floor, float("-inf"))
    return logits


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
            _plain_greedy(p, out, bad)
            for p, out, bad in zip(params, output_token_ids, bad_words_ids)
        )
        if plain and not guided:
            return cls(
                num_rows=num_rows,
                vocab_size=vocab_size,
                device=device,
                all_greedy=True,
                greedy=None,
                temperature=None,
                top_k=None,
                max_top_k=0,
                top_p=None,
                min_p=None,
                mask_rows=None,
                mask_ids=None,
                bias_rows=None,
                bias_ids=None,
                bias_values=None,
                guided_rows=None,
                guided_bitmask=None,
                prompt_ids=None,
                output_ids=None,
                repetition_penalty=None,
                presence_penalty=None,
                frequency_penalty=None,
            )
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


def _allowed(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[G, W] int32 bits -> [G, width] bool (ids past the bitmask's vocabulary are not allowed)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, device=bitmask.device, dtype=torch.int32)) & 1
    allowed = bits.flatten(1).bool()
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    return torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)


def _is_greedy(p: SamplingParams) -> bool:
    return p.greedy or p.temperature < _TEMP_EPS


def _plain_greedy(
    p: SamplingParams,
    output_token_ids: list[int],
    bad_words: TokenSequenceMatcher | list[list[int]] | None,
) -> bool:
    """A row that takes the argmax of its logits as they are: greedy, no penalty, no id to mask, no logprobs (the
    common batch, which SamplingBatch.build then makes without its per-row lists)."""
    return (
        _is_greedy(p)
        and not bad_words
        and not p.logit_bias
        and len(output_token_ids) >= p.min_tokens
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.logprobs is None
    )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64, the sampled ids
    logprobs: torch.Tensor | None = (
        None  # [B] fp32 logprob of the sampled id (None if no request asked)
    )
    top_logprobs: torch.Tensor | None = None  # [B, K] fp32, K = max requested logprobs, descending
    top_token_ids: torch.Tensor | None = None  # [B, K] int64
    ranks: torch.Tensor | None = None  # [B] int64 rank of the sampled id (1 = most likely)


class Sampler:
    """Stateless: turns logits [B, V] into one token per row following SamplingBatch (see module doc).

    fused: draw with the Triton kernel (None: on CUDA tensors)."""

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        as_is = (
            batch.mask_rows is None
            and batch.bias_rows is None
            and batch.guided_rows is None
            and not batch.has_penalties
            and batch.max_num_logprobs is None
        )
        if batch.all_greedy and as_is:
            # widening to fp32 is exact, so the argmax of the logits as they are is the same id, without a copy
            return SamplerOutput(token_ids=logits[:, : batch.vocab_size].argmax(dim=-1))
        fused = self.fused if self.fused is not None else logits.is_cuda
        if fused and as_is:
            return SamplerOutput(token_ids=self._fused_sample(logits, batch))
        logits = logits.to(torch.float32, copy=True)  # [B, V]
        if logits.shape[1] > batch.vocab_size:
            logits[:, batch.vocab_size :] = float("-inf")
        if batch.bias_rows is not None:
            logits.view(-1).index_add_(
                0, batch.bias_rows * logits.shape[1] + batch.bias_ids, batch.bias_values
            )
        if batch.guided_rows is not None:
            rows = logits.index_select(0, batch.guided_rows)
            rows.masked_fill_(~_allowed(batch.guided_bitmask, logits.shape[1]), float("-inf"))
            logits.index_copy_(0, batch.guided_rows, rows)
        if batch.mask_rows is not None:
            # not logits[rows, ids] = -inf: on CUDA that copies a CPU scalar to the device, and the pageable
            # copy waits for every queued kernel (a host sync per step for any request with min_tokens)
            flat = batch.mask_rows * logits.shape[1] + batch.mask_ids
            logits.view(-1).index_fill_(0, flat, float("-inf"))
        if batch.has_penalties:
            logits = apply_penalties(
                logits,
                batch.prompt_ids,
                batch.output_ids,
                batch.repetition_penalty,
                batch.presence_penalty,
                batch.frequency_penalty,
            )

        logprobs = (
            logits.log_softmax(dim=-1) if batch.max_num_logprobs is not None else None
        )  # [B, V]

        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        elif fused:
            token_ids = self._fused_sample(logits, batch)
        else:
            greedy_ids = logits.argmax(dim=-1) if batch.greedy is not None else None
            token_ids = self._sample(logits, batch)
            if greedy_ids is not None:
                token_ids = torch.where(batch.greedy, greedy_ids, token_ids)

        if logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
        ranks = (logprobs > chosen).sum(dim=-1) + 1  # [B]
        top_vals, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)  # [B, K] each
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen.squeeze(1),
            top_logprobs=top_vals,
            top_token_ids=top_ids,
            ranks=ranks,
        )

    def warm_up(self, logits: torch.Tensor, vocab_size: int) -> None:
        """Compile what this sampler launches for `logits` (one row as the LM head returns it): on CUDA the fused
        kernel for the head's dtype and for fp32 logits (after penalties / masks / logprobs), one variant each
        for every mix of parameters; otherwise the first sampled step waits for the compile (0.7 s on an H100)."""
        sampled = dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
        for params in (
            SamplingParams(**sampled),
            SamplingParams(**sampled, repetition_penalty=1.1),
        ):
            batch = SamplingBatch.build(
                [params], [[0]], [[]], [None], [None], [[]], vocab_size, logits.device
            )
            self(logits.clone(), batch)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)

    @staticmethod
    def _fused_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        from mmserve.kernels.sampling import sample

        assert batch.seeds is not None, (
            "the fused sampler draws from SamplingBatch.seeds, built for CUDA batches"
        )
        return sample(
            logits if logits.stride(1) == 1 else logits.contiguous(),
            batch.vocab_size,
            batch.seeds,
            batch.greedy,
            batch.temperature,
            batch.top_k,
            batch.max_top_k,
            batch.top_p,
            batch.min_p,
        )

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exact categorical draw per row; modifies `logits` in place. Greedy rows get a throwaway draw."""
        if batch.temperature is not None:
            logits.div_(batch.temperature.unsqueeze(1))
        if batch.top_k is not None or batch.top_p is not None or batch.min_p is not None:
            logits = apply_top_k_top_p_min_p(
                logits, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k
            )
        probs = logits.softmax(dim=-1)  # [B, V]
        q = torch.empty_like(probs)  # [B, V] Exp(1) noise
        if batch.any_unseeded:
            q.exponential_()
        else:
            q.fill_(1.0)  # greedy rows only need finite noise
        for row, gen in batch.seeded:
            q[row].exponential_(generator=gen)
        # exponential_ may return exactly 0 on some backends; p / 0 would be inf (or nan for p = 0)
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)
