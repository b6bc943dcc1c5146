"""The torch sampler's logits filters (worker/sampler.py), on fp32 logits [B, V]: repetition / presence /
frequency penalties, and the top-k / top-p / min-p masks (top-k's threshold shared with the fused sampler).
"""

from __future__ import annotations

import torch


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
