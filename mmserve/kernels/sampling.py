"""Fused sampling (Triton): one program per row turns logits into a token id without a sort or an fp32 copy.

What it does per row, on the logits as they are (bf16 / fp16 / fp32, columns >= vocab ignored):
  greedy rows: the first index of the max;
  sampling rows: temperature, top-k, top-p (on the top-k-renormalised distribution) and min-p (relative to
  the max prob), then an exact categorical draw by inversion: one uniform u per draw from Philox (seeded per
  row, so a row's draw depends on its seed alone, not on the batch), and the token where the running sum of
  exp((l - max) / T) over the row, in index order, first exceeds u times the set's mass.

How:
  top-k: a threshold, the row's k-th largest logit (torch.topk over the batch's largest k, before the kernel);
    tokens tied with the k-th are all kept, as in the torch sampler.
  min-p: a threshold, l >= max + T * log(min_p).
  top-p: rejection. Draw s from the top-k / min-p set; s is in the top-p set iff the mass of the tokens with a
    larger logit is < p (relative to the top-k mass). If not, no token with a logit <= l_s is either, so the
    next draw is among logits > l_s only, whose mass is the one just summed. Accepted draws are exact samples
    of the top-p distribution (the proposal always contains the set). Tokens tied at the cut are all kept (the
    torch sampler keeps them in sort order). After MAX_TRIES rejections (vanishingly rare) the row takes its
    max, which is always in the set.
Passes over the row: one (max and mass, online) + per draw one scan (+ one mass sum with top-p, + one with
min-p on the first draw). Penalties, masks and logprobs are the torch sampler's work before this
(worker/sampling_filters.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_TRIES = 64


@triton.jit
def _load_row(base, start, cols, vocab):
    idx = start + cols
    return tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)


@triton.jit
def _mass(base, cols, vocab, floor, above, top, scale, BLOCK: tl.constexpr):
    """sum of exp((l - top) * scale) over logits l >= floor and l > above."""
    total = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = _load_row(base, start, cols, vocab)
        keep = (x >= floor) & (x > above)
        total += tl.sum(tl.where(keep, tl.exp((x - top) * scale), 0.0), 0)
    return total


@triton.jit
def _draw(base, cols, vocab, cut, above, top, scale, target, BLOCK: tl.constexpr):
    """(index, logit) of the first token whose running mass over {l >= cut, l > above} exceeds target; the
    set's last token if rounding leaves the target beyond the total."""
    run = tl.zeros((), tl.float32)
    pick = tl.full((), -1, tl.int32)
    pick_logit = tl.full((), float("-inf"), tl.float32)
    last = tl.full((), -1, tl.int32)
    last_logit = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = _load_row(base, start, cols, vocab)
        ok = (x >= cut) & (x > above)
        w = tl.where(ok, tl.exp((x - top) * scale), 0.0)
        hit = ok & (tl.cumsum(w, 0) + run > target)
        idx = tl.min(tl.where(hit, start + cols, vocab), 0)
        first = (pick < 0) & (idx < vocab)
        pick_logit = tl.where(
            first, tl.max(tl.where(start + cols == idx, x, float("-inf")), 0), pick_logit
        )
        pick = tl.where(first, idx, pick)
        block_last = tl.max(tl.where(ok, start + cols, -1), 0)
        last_logit = tl.where(
            block_last >= 0,
            tl.max(tl.where(start + cols == block_last, x, float("-inf")), 0),
            last_logit,
        )
        last = tl.maximum(last, block_last)
        run += tl.sum(w, 0)
    missed = pick < 0
    return tl.where(missed, last, pick), tl.where(missed, last_logit, pick_logit)


# Which per-row tensors a launch has is a runtime bit set, not constexprs: one compiled variant per logits dtype
# serves every mix of parameters, so the engine compiles it at startup (Sampler.warm_up) and no
# request's first sampled step waits for a compile.
_GREEDY: tl.constexpr = tl.constexpr(1)
_TEMP: tl.constexpr = tl.constexpr(2)
_FLOOR: tl.constexpr = tl.constexpr(4)
_TOP_P: tl.constexpr = tl.constexpr(8)
_MIN_P: tl.constexpr = tl.constexpr(16)


@triton.jit(do_not_specialize=["flags"])
def _sample_kernel(
    logits_ptr,
    stride,
    vocab,
    out_ptr,
    greedy_ptr,
    temp_ptr,
    floor_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    flags,
    MAX_TRIES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    cols = tl.arange(0, BLOCK)

    temp = tl.full((), 1.0, tl.float32)
    if (flags & _TEMP) != 0:
        temp = tl.load(temp_ptr + row)
    scale = 1.0 / temp
    floor = tl.full((), float("-inf"), tl.float32)  # inclusive: the top-k cut
    if (flags & _FLOOR) != 0:
        floor = tl.load(floor_ptr + row)

    # one pass: the max (first index on ties) and the top-k set's mass relative to it (online rescaling)
    top = tl.full((), float("-inf"), tl.float32)
    top_idx = tl.zeros((), tl.int32)
    z = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = _load_row(base, start, cols, vocab)
        block_max = tl.max(x, 0)
        block_idx = tl.min(tl.where(x == block_max, start + cols, vocab), 0)
        top_idx = tl.where(block_max > top, block_idx, top_idx)
        new_top = tl.maximum(top, block_max)
        rescale = tl.where(new_top > float("-inf"), tl.exp((top - new_top) * scale), 0.0)
        z = z * rescale + tl.sum(tl.where(x >= floor, tl.exp((x - new_top) * scale), 0.0), 0)
        top = new_top

    token = top_idx
    greedy = tl.zeros((), tl.int32)
    if (flags & _GREEDY) != 0:
        greedy = (tl.load(greedy_ptr + row) != 0).to(tl.int32)
    if greedy == 0:
        p = tl.full((), 1.0, tl.float32)
        if (flags & _TOP_P) != 0:
            p = tl.load(top_p_ptr + row)
        cut = floor  # inclusive: top-k and min-p together
        mass = z  # of the set the next draw is from
        if (flags & _MIN_P) != 0:
            min_p = tl.load(min_p_ptr + row)
            if min_p > 0.0:
                cut = tl.maximum(cut, top + temp * tl.log(min_p))
                mass = _mass(base, cols, vocab, cut, float("-inf"), top, scale, BLOCK)
        seed = tl.load(seed_ptr + row)

        pivot = tl.full(
            (), float("-inf"), tl.float32
        )  # exclusive: draws at or below it were rejected by top-p
        tries = tl.zeros((), tl.int32)
        done = tl.zeros((), tl.int32)
        while done == 0:
            u = tl.rand(seed, tries)
            pick, pick_logit = _draw(base, cols, vocab, cut, pivot, top, scale, u * mass, BLOCK)
            accept = pick >= 0
            if p < 1.0:  # p = 1 without top-p
                above = _mass(base, cols, vocab, floor, pick_logit, top, scale, BLOCK)
                accept = accept & (above < p * z)
                mass = above  # the set above a rejected draw is the next one
            tries += 1
            token = tl.where(accept, pick, top_idx)
            pivot = tl.where(accept, pivot, pick_logit)
            done = (accept | (tries >= MAX_TRIES)).to(tl.int32)
    tl.store(out_ptr + row, token.to(tl.int64))


def top_k_active(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] bool: the rows whose top-k cuts anything (0 < k < vocab)."""
    return (top_k > 0) & (top_k < vocab)


def kth_largest(
    logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None
) -> torch.Tensor:
    """[B] in logits' dtype: each row's top_k-th largest value of logits [B, V], -inf where top-k is off (top_k
    <= 0 or >= V). max_top_k: the largest active k, known on the host (None: read from top_k, a device sync).
    The top-k threshold of both samplers (this kernel's and worker/sampling_filters.py's torch one)."""
    vocab = logits.shape[-1]
    active = top_k_active(top_k, vocab)
    if max_top_k is None:
        max_top_k = int(torch.where(active, top_k, 1).max())
    k_max = max(1, min(max_top_k, vocab))
    values = logits.topk(k_max, dim=-1).values  # [B, k_max] descending
    kth = values.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1)).squeeze(1)
    return torch.where(active, kth, float("-inf"))


def sample(
    logits: torch.Tensor,
    vocab_size: int,
    seeds: torch.Tensor,
    greedy: torch.Tensor | None = None,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    max_top_k: int | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of `logits` [B, >= vocab_size] -> [B] int64 (see the module doc).

    seeds [B] int64 (the row's Philox seed); greedy [B] bool; temperature [B] fp32 (> 0 on sampling rows);
    top_k [B] int (<= 0 or >= vocab_size: off) with max_top_k its largest value (None: read from top_k, a
    host sync); top_p [B] fp32 (1: off); min_p [B] fp32 (0: off). None = off for every row. Rows must be
    contiguous (stride(1) == 1)."""
    assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [B, V] with contiguous rows"
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    floor = (
        kth_largest(logits[:, :vocab_size], top_k, max_top_k).float() if top_k is not None else None
    )
    block = min(8192, triton.next_power_of_2(vocab_size))
    f32 = _placeholder(
        logits.device, torch.float32
    )  # a tensor a launch does not have: typed, never read
    given = [
        (greedy, _GREEDY, _placeholder(logits.device, torch.bool)),
        (temperature, _TEMP, f32),
        (floor, _FLOOR, f32),
        (top_p, _TOP_P, f32),
        (min_p, _MIN_P, f32),
    ]
    flags = sum(bit.value for t, bit, _ in given if t is not None)
    per_row = [t if t is not None else placeholder for t, _, placeholder in given]
    _sample_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab_size,
        out,
        *per_row,
        seeds,
        flags,
        MAX_TRIES=_MAX_TRIES,
        BLOCK=block,
        num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
    )
    return out


_placeholders: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """One element of `dtype` on `device`, passed for an absent per-row tensor: a pointer of the same type as a
    present one, so that both launches share one compiled variant."""
    key = (device, dtype)
    if key not in _placeholders:
        _placeholders[key] = torch.zeros(1, dtype=dtype, device=device)
    return _placeholders[key]
