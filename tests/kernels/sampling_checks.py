"""Checks of the fused sampling kernel (kernels/sampling.py) against the torch sampler's exact distribution.

Registered in check_registry.CHECKS (imported by triton_checks). Interpreted Triton runs ~10 ms per row, so
the statistics here use a few hundred draws per distribution; tests/gpu/test_sampler_gpu.py repeats them
with 10^5 draws at real vocabulary sizes.
"""

from __future__ import annotations

import math

import torch

from tests.kernels.check_registry import check


def reference_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The fused sampler's target distribution for one row of logits [V] (fp32 probabilities), from torch.

    The torch sampler's filters (worker/sampling_filters.py) for top-k and min-p; top-p written out with ties kept:
    a token stays iff the top-k mass of the tokens with a strictly larger logit is < top_p (the torch sampler
    cuts a tie at the boundary in sort order; bf16 logits at real vocabulary sizes have such ties)."""
    from mmserve.worker.sampling_filters import apply_top_k_top_p_min_p

    row = logits.float().unsqueeze(0) / temperature
    row = apply_top_k_top_p_min_p(
        row.clone(), torch.tensor([top_k]) if top_k else None, None, None, top_k or None
    )
    if top_p < 1.0:
        probs = row.softmax(dim=-1)[0].double()
        asc, order = row[0].sort()
        below_or_tied = torch.searchsorted(asc, row[0], right=True)  # tokens with logit <= each
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), probs[order].cumsum(0)])
        above = cum[-1] - cum[below_or_tied]
        row = row.masked_fill((above >= top_p).unsqueeze(0), float("-inf"))
    if min_p > 0.0:
        row = apply_top_k_top_p_min_p(row, None, None, torch.tensor([min_p]))
    return row.softmax(dim=-1)[0]


def assert_draws_follow(
    draws: torch.Tensor, probs: torch.Tensor, what: str, z: float = 4.5
) -> None:
    """Draws [N] never leave the support of probs [V], and their counts pass a chi-square test (tokens expected
    fewer than 5 times share one bin; Wilson-Hilferty quantile at `z` standard deviations: a false alarm about
    once in 10^5 runs)."""
    n = draws.numel()
    counts = torch.bincount(draws.cpu(), minlength=probs.numel()).double()
    probs = probs.cpu().double()
    outside = counts[probs == 0].sum().item()
    assert outside == 0, f"{what}: {outside:.0f} draws of tokens with probability 0"
    own = probs * n >= 5
    rest = (probs > 0) & ~own
    observed = torch.cat([counts[own], counts[rest].sum().view(1)])
    expected = torch.cat([probs[own], probs[rest].sum().view(1)]) * n
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    df = max(int(keep.sum()) - 1, 1)
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat <= limit, (
        f"{what}: chi-square {stat:.1f} > {limit:.1f} (df {df}); counts {observed.tolist()[:20]}"
    )


# (temperature, top_k, top_p, min_p): each filter alone and all together, a top-k cut inside a tie;
# temperatures far from 1 so that a kernel ignoring them fails the chi-square test by a wide margin
SAMPLING_CASES = [
    (0.5, 0, 1.0, 0.0),
    (0.6, 4, 1.0, 0.0),
    (2.0, 0, 0.75, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.9, 5, 0.8, 0.05),
]


def draws_for_cases(
    logits: torch.Tensor,
    cases: list,
    per_case: int,
    device,
    dtype=torch.float32,
    padded: int = 0,
    rows_per_launch: int = 8192,
) -> torch.Tensor:
    """Rows of `logits` [V] repeated per_case times for each case (cases interleaved so that neighbouring rows
    have different filters) -> the drawn ids [len(cases), per_case]. `padded` extra columns hold huge logits
    that must never be drawn (a padded lm_head)."""
    from mmserve.kernels.sampling import sample

    vocab = logits.numel()
    rows = len(cases) * per_case
    table = torch.tensor([[t, k, p, m] for t, k, p, m in cases], dtype=torch.float64).repeat(
        per_case, 1
    )
    row = torch.cat([logits.float(), torch.full((padded,), 1e4)]).to(dtype).to(device)
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 5
    out = []
    for lo in range(0, rows, rows_per_launch):
        part = table[lo : lo + rows_per_launch]
        n = len(part)
        out.append(
            sample(
                row.expand(n, vocab + padded),
                vocab,
                seeds[lo : lo + n].to(device),  # stride-0 rows
                temperature=part[:, 0].float().to(device),
                top_k=part[:, 1].long().to(device),
                top_p=part[:, 2].float().to(device),
                min_p=part[:, 3].float().to(device),
            ).cpu()
        )
    return torch.cat(out).view(per_case, len(cases)).t()


@check
def check_sampling_follows_the_torch_distribution(device):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(14, generator=gen) * 1.5
    logits[9] = logits[3] = logits.topk(4).values[3]  # tie the 4th largest: top-k = 4 keeps both
    draws = draws_for_cases(logits, SAMPLING_CASES, 160, device, padded=3)
    for case, got in zip(SAMPLING_CASES, draws):
        assert_draws_follow(got, reference_probs(logits, *case), f"case {case}")


@check
def check_sampling_greedy_rows_and_degenerate_filters_take_the_max(device):
    from mmserve.kernels.sampling import sample

    gen = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(6, 37, generator=gen) * 3).to(dtype)
        logits[:, 33:] = 1e4  # padded columns beyond the vocabulary
        logits[5, 4] = logits[5, 20] = (
            logits[5, :33].max() + 1
        )  # a tie at the max: the first index wins
        want = logits[:, :33].float().argmax(dim=-1)
        seeds = torch.arange(6, dtype=torch.int64)
        rows = dict(
            greedy=torch.tensor([True, False, False, False, False, True]),
            temperature=torch.tensor([1.0, 0.5, 1.0, 2.0, 1.0, 1.0]),
            top_k=torch.tensor([0, 1, 0, 0, 3, 0]),  # row 1: top-k 1
            top_p=torch.tensor([1.0, 1.0, 1e-6, 1.0, 1.0, 1.0]),  # row 2: top-p tiny
            min_p=torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 0.0]),
        )  # row 3: min-p 1
        got = sample(
            logits.to(device), 33, seeds.to(device), **{k: v.to(device) for k, v in rows.items()}
        ).cpu()
        assert got[:4].tolist() == want[:4].tolist() and int(got[5]) == 4, (
            f"{dtype}: {got} vs {want}"
        )
        assert int(got[4]) in logits[4, :33].float().topk(3).indices.tolist(), (
            f"{dtype}: top-k 3 row drew {got[4]}"
        )


@check
def check_sampling_draws_depend_on_the_seed_alone(device):
    from mmserve.kernels.sampling import sample

    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(8, 50, generator=gen)
    seeds = torch.tensor([3, 4, 5, 6, 7, 8, 9, 10], dtype=torch.int64)
    temps = torch.linspace(0.5, 2.0, 8)
    first = sample(logits.to(device), 50, seeds.to(device), temperature=temps.to(device)).cpu()
    order = torch.tensor([7, 2, 5, 0, 1, 6, 3, 4])
    again = sample(
        logits[order].to(device), 50, seeds[order].to(device), temperature=temps[order].to(device)
    )
    assert again.cpu().tolist() == first[order].tolist(), (
        "a row's draw changed with its position in the batch"
    )
    many = sample(
        logits[:1].expand(64, 50).contiguous().to(device),
        50,
        torch.arange(64, dtype=torch.int64, device=device),
    ).cpu()
    assert len(set(many.tolist())) > 8, f"64 seeds drew only {sorted(set(many.tolist()))}"
