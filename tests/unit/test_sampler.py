"""Sampler: masks, penalties and logprobs against hand-written references; seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import Sampler
from mmserve.worker.sampling_batch import SamplingBatch
from mmserve.worker.sampling_filters import apply_penalties, apply_top_k_top_p_min_p

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def make_batch(
    params: list[SamplingParams],
    vocab: int,
    outputs=None,
    prompts=None,
    seeds_gen=True,
    eos=None,
    bad=None,
) -> SamplingBatch:
    n = len(params)
    gens = [
        torch.Generator().manual_seed(p.seed) if seeds_gen and p.seed is not None else None
        for p in params
    ]
    return SamplingBatch.build(
        params,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        generators=gens,
        eos_token_ids=eos or [None] * n,
        bad_words_ids=bad or [[] for _ in range(n)],
        vocab_size=vocab,
        device=CPU,
    )


def finite_mask(t: torch.Tensor) -> list[list[bool]]:
    return torch.isfinite(t).tolist()


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_rows_take_argmax_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 32)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=1, temperature=0.7),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, top_p=0.1),
    ]
    out = Sampler()(logits, make_batch(params, 32))
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (4,)
    assert out.token_ids[[0, 1, 3]].tolist() == logits.argmax(-1)[[0, 1, 3]].tolist()
    assert out.logprobs is None and out.top_logprobs is None and out.top_token_ids is None


def test_all_greedy_half_precision_and_padded_vocab():
    logits = torch.zeros(2, 10, dtype=torch.bfloat16)
    logits[0, 3] = 5.0
    logits[1, 8] = 9.0  # column >= vocab_size: padded lm_head, never sampled
    logits[1, 6] = 1.0
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 2, vocab=8))
    assert out.token_ids.tolist() == [3, 6]


def test_plain_greedy_batches_skip_the_per_row_lists_and_the_fp32_copy():
    """A batch of plain greedy rows is built without the per-row lists and sampled by an argmax of the logits
    as given; any row with something to apply (a penalty, a pending min_tokens, logprobs) takes the full path."""
    torch.manual_seed(3)
    logits = torch.randn(5, 40, dtype=torch.float16) * 4
    logits[:, 37:] = 100.0  # padded lm_head columns beyond the vocabulary
    plain = [
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=1e-9),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]),
    ] + [SamplingParams(temperature=0.0)] * 2
    outputs = [[1], [], [7, 8], [], [2, 2, 2]]  # row 2 has reached min_tokens
    batch = make_batch(plain, 37, outputs=outputs)
    assert (
        batch.all_greedy
        and batch.mask_rows is None
        and not batch.has_penalties
        and batch.max_num_logprobs is None
    )
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == logits.float()[:, :37].argmax(-1).tolist()
    for odd in (
        SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, logprobs=2),
    ):
        mixed = make_batch(plain[:4] + [odd], 37, outputs=outputs)
        assert (
            mixed.mask_rows is not None or mixed.has_penalties or mixed.max_num_logprobs is not None
        )


def test_no_optional_tensors_without_need():
    batch = make_batch([SamplingParams(), SamplingParams(temperature=0.0)], 16)
    assert (
        batch.temperature is None
        and batch.top_k is None
        and batch.top_p is None
        and batch.min_p is None
    )
    assert batch.prompt_ids is None and batch.output_ids is None and not batch.has_penalties
    assert batch.mask_rows is None and batch.max_num_logprobs is None and batch.seeded == []


# ---------------------------------------------------------------------------------------------- seeding


def _run_steps(
    params: list[SamplingParams], logits_steps: list[torch.Tensor], rows: list[int]
) -> list[int]:
    """Sample several steps with one generator per seeded request (seeded once, like the engine does)."""
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    n = len(params)
    ids = []
    for logits in logits_steps:
        batch = SamplingBatch.build(
            params, [[]] * n, [[]] * n, gens, [None] * n, [[]] * n, logits.shape[1], CPU
        )
        ids.append(Sampler()(logits[rows], batch).token_ids)
    return ids


def test_seeded_row_reproducible_across_batch_composition():
    torch.manual_seed(1)
    steps = [torch.randn(4, 500) for _ in range(6)]  # row 0 = the seeded request's logits
    seeded = SamplingParams(seed=1234, temperature=1.3, top_p=0.9)
    alone = [t[0].item() for t in _run_steps([seeded], steps, [0])]
    again = [t[0].item() for t in _run_steps([seeded], steps, [0])]
    others = [SamplingParams(), SamplingParams(seed=99, top_k=5), SamplingParams(temperature=0.0)]
    mixed = [
        t[2].item()
        for t in _run_steps([others[0], others[1], seeded, others[2]], steps, [1, 2, 0, 3])
    ]
    assert alone == again == mixed
    other_seed = [
        t[0].item()
        for t in _run_steps([SamplingParams(seed=4321, temperature=1.3, top_p=0.9)], steps, [0])
    ]
    assert other_seed != alone


def test_unseeded_rows_follow_global_rng():
    logits = torch.randn(3, 200)
    params = [SamplingParams()] * 3
    torch.manual_seed(5)
    a = Sampler()(logits, make_batch(params, 200)).token_ids
    torch.manual_seed(5)
    b = Sampler()(logits, make_batch(params, 200)).token_ids
    assert a.tolist() == b.tolist()


# ---------------------------------------------------------------------------------------------- top-k / top-p / min-p


def _reference_keep(row: list[float], top_k: int, top_p: float, min_p: float) -> list[bool]:
    vocab = len(row)
    order = sorted(range(vocab), key=lambda i: -row[i])
    keep = set(order[:top_k] if 0 < top_k < vocab else order)
    kept = [i for i in order if i in keep]
    m = max(row[i] for i in kept)
    z = sum(math.exp(row[i] - m) for i in kept)
    if top_p < 1.0:
        cum, chosen = 0.0, []
        for i in kept:
            chosen.append(i)
            cum += math.exp(row[i] - m) / z
            if cum >= top_p:
                break
        keep = set(chosen)
    top = max(math.exp(row[i] - m) / z for i in keep)
    return [i in keep and math.exp(row[i] - m) / z >= min_p * top for i in range(vocab)]


@pytest.mark.parametrize("with_top_p", [False, True])
def test_top_k_top_p_min_p_match_reference(with_top_p: bool):
    torch.manual_seed(2)
    vocab = 40
    logits = torch.randn(7, vocab) * 2
    settings = [
        (0, 1.0, 0.0),
        (5, 1.0, 0.0),
        (1, 1.0, 0.0),
        (0, 1.0, 0.2),
        (12, 1.0, 0.05),
        (vocab, 1.0, 0.0),
        (-1, 1.0, 0.5),
    ]
    if with_top_p:
        settings = [
            (k, p, mp) for (k, _, mp), p in zip(settings, [0.5, 0.9, 1.0, 0.3, 0.8, 0.99, 0.95])
        ]
    top_k = torch.tensor([s[0] for s in settings])
    top_p = torch.tensor([s[1] for s in settings]) if with_top_p else None
    min_p = torch.tensor([s[2] for s in settings])
    out = apply_top_k_top_p_min_p(logits.clone(), top_k, top_p, min_p)
    for r, (k, p, mp) in enumerate(settings):
        expected = _reference_keep(logits[r].tolist(), k, p, mp)
        assert finite_mask(out[r]) == expected, (r, k, p, mp)
        kept = torch.isfinite(out[r])
        assert torch.equal(out[r][kept], logits[r][kept])


def test_top_p_always_keeps_top_token():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    out = apply_top_k_top_p_min_p(logits.clone(), None, torch.tensor([1e-6, 0.5]), None)
    assert finite_mask(out)[0] == [True, False, False]
    assert sum(finite_mask(out)[1]) >= 1


def test_top_k_only_path_without_host_max():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    out = apply_top_k_top_p_min_p(logits.clone(), torch.tensor([2, 0]), None, None)
    assert finite_mask(out) == [[True, False, True, False], [True, True, True, True]]


# ---------------------------------------------------------------------------------------------- penalties


def test_penalties_match_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0], [1.0, 1.0, -2.0, 4.0, -0.5, 2.0]])
    prompt = [[0, 1], [5]]
    output = [[2, 2, 3], [3, 5, 5, 5]]
    rep, pres, freq = [2.0, 0.5], [0.3, -0.2], [0.1, 0.4]
    pad = lambda rows: torch.tensor([r + [-1] * (max(map(len, rows)) - len(r)) for r in rows])  # noqa: E731
    got = apply_penalties(
        logits.clone(),
        pad(prompt),
        pad(output),
        torch.tensor(rep),
        torch.tensor(pres),
        torch.tensor(freq),
    )
    expected = logits.clone()
    for b in range(2):
        for v in range(6):
            x = logits[b, v].item()
            if v in prompt[b] or v in output[b]:
                x = x / rep[b] if x > 0 else x * rep[b]
            count = output[b].count(v)
            x -= freq[b] * count + (pres[b] if count else 0.0)
            expected[b, v] = x
    assert torch.allclose(got, expected, atol=1e-6)


def test_penalties_in_sampler_only_for_rows_that_ask():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0], [3.0, 2.9, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    batch = make_batch(params, 4, outputs=[[0], [0]], prompts=[[3], [3]])
    assert batch.presence_penalty is None and batch.frequency_penalty is None
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == [1, 0]  # row 0: 3/1.5 = 2 < 2.9
    penalised = torch.tensor([2.0, 2.9, 0.0, 0.0])  # id 3 (prompt, logit 0): 0 * 1.5 = 0
    assert torch.allclose(out.logprobs[0], penalised.log_softmax(-1)[1])


def test_presence_frequency_use_output_only():
    logits = torch.zeros(1, 4)
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, logprobs=4)]
    out = Sampler()(logits, make_batch(params, 4, outputs=[[1, 1, 2]], prompts=[[3, 3]]))
    expected = torch.tensor([0.0, -2.0, -1.5, 0.0]).log_softmax(-1)
    lp = dict(zip(out.top_token_ids[0].tolist(), out.top_logprobs[0].tolist()))
    assert [lp[i] for i in range(4)] == pytest.approx(expected.tolist(), abs=1e-6)


# ---------------------------------------------------------------------------------------------- masks


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 8.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], logprobs=0)
    sampler = Sampler()
    out = sampler(logits, make_batch([p], 8, outputs=[[0, 1]], eos=[2]))
    assert out.token_ids.tolist() == [6] and out.logprobs.isfinite().all()
    lp_batch = make_batch(
        [SamplingParams(min_tokens=3, stop_token_ids=[5], logprobs=8)], 8, outputs=[[0]], eos=[2]
    )
    lp = sampler(logits, lp_batch)
    masked = {
        i for i, v in zip(lp.top_token_ids[0].tolist(), lp.top_logprobs[0].tolist()) if v == NEG_INF
    }
    assert masked == {2, 5}
    assert sampler(logits, make_batch([p], 8, outputs=[[0, 1, 3]], eos=[2])).token_ids.tolist() == [
        2
    ]
    # eos from params when the engine gives none; ignore_eos keeps eos sampleable
    q = SamplingParams(temperature=0.0, min_tokens=2, eos_token_id=2)
    assert sampler(logits, make_batch([q], 8, outputs=[[0]])).token_ids.tolist() == [5]
    r = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    assert sampler(logits, make_batch([r], 8, outputs=[[0]], eos=[2])).token_ids.tolist() == [2]


def test_bad_words_single_and_multi_token():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 0.0]] * 3)
    params = [SamplingParams(temperature=0.0)] * 3
    bad = [[[3]], [[1, 2, 3], [4]], [[1, 2, 3]]]
    outputs = [[0], [5, 1, 2], [2, 1]]  # row 1: prefix [1, 2] matches tail; row 2: it does not
    out = Sampler()(logits, make_batch(params, 6, outputs=outputs, bad=bad))
    assert out.token_ids.tolist() == [4, 2, 3]


# ---------------------------------------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_before_temperature_and_sorted():
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=5.0, top_k=3, logprobs=5),
        SamplingParams(temperature=0.5),
    ]
    out = Sampler()(logits, make_batch(params, 30))
    ref = logits.log_softmax(-1)
    assert out.top_logprobs.shape == (3, 5) and out.top_token_ids.shape == (3, 5)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    vals, ids = ref.sort(-1, descending=True)
    assert torch.equal(out.top_token_ids, ids[:, :5])
    assert torch.allclose(out.top_logprobs, vals[:, :5])
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert out.ranks[0].item() == 1
    assert out.token_ids[1].item() in ids[1, :3].tolist()  # top-k=3 respected while sampling
    expected_rank = (ref[1] > ref[1, out.token_ids[1]]).sum().item() + 1
    assert out.ranks[1].item() == expected_rank


def test_logprobs_zero_requested_gives_empty_top():
    out = Sampler()(
        torch.randn(2, 9), make_batch([SamplingParams(logprobs=0), SamplingParams()], 9)
    )
    assert out.logprobs.shape == (2,) and out.top_logprobs.shape == (2, 0)


# ---------------------------------------------------------------------------------------------- distribution


def _freq_of_one(params: SamplingParams, logits_row: list[float], rows: int) -> list[float]:
    logits = torch.tensor([logits_row] * rows)
    ids = Sampler()(logits, make_batch([params] * rows, len(logits_row))).token_ids
    return torch.bincount(ids, minlength=len(logits_row)).float().div(rows).tolist()


def test_empirical_distribution_matches():
    torch.manual_seed(4)
    n = 20000
    tol = 0.015  # ~4.5 sigma at n=20000
    two = [math.log(0.3), math.log(0.7)]
    assert _freq_of_one(SamplingParams(), two, n)[0] == pytest.approx(0.3, abs=tol)
    # temperature 2: p ~ sqrt(p)
    t2 = math.sqrt(0.3) / (math.sqrt(0.3) + math.sqrt(0.7))
    assert _freq_of_one(SamplingParams(temperature=2.0), two, n)[0] == pytest.approx(t2, abs=tol)
    # top-k 2 of 3 renormalises; top-p 0.5 keeps only the top token; min-p 0.5 drops p=0.3 vs 0.7
    three = [math.log(0.5), math.log(0.3), math.log(0.2)]
    freq = _freq_of_one(SamplingParams(top_k=2), three, n)
    assert freq[0] == pytest.approx(0.625, abs=tol) and freq[2] == 0.0
    assert _freq_of_one(SamplingParams(top_p=0.5), three, n) == [1.0, 0.0, 0.0]
    assert _freq_of_one(SamplingParams(min_p=0.5), two, n) == [0.0, 1.0]


def test_seeded_row_distribution_over_steps():
    p = SamplingParams(seed=7)
    gen = torch.Generator().manual_seed(7)
    logits = torch.tensor([[math.log(0.3), math.log(0.7)]])
    sampler = Sampler()
    batch = SamplingBatch.build([p], [[]], [[]], [gen], [None], [[]], 2, CPU)
    draws = [sampler(logits, batch).token_ids.item() for _ in range(2000)]
    assert draws.count(0) / len(draws) == pytest.approx(0.3, abs=0.04)


def test_cpu_batches_leave_the_fused_samplers_seeds_out_and_keep_the_global_rng():
    """Seeds are drawn (from torch's global RNG) only for batches the fused CUDA sampler may take: a CPU batch
    has none, building it consumes no random number, and forcing the fused sampler on it is a clear error."""
    params = [SamplingParams(temperature=0.8, top_k=2), SamplingParams(seed=3, top_p=0.9)]
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    batch = make_batch(params, vocab=4)
    assert batch.seeds is None and not batch.all_greedy
    assert torch.equal(torch.rand(1), expected), "building a CPU batch drew from the global RNG"
    with pytest.raises(AssertionError, match="SamplingBatch.seeds"):
        Sampler(fused=True)(torch.zeros(2, 4), batch)


def test_logit_bias_is_added_first_masks_still_win_and_logprobs_see_it():
    vocab = 6
    logits = torch.tensor(
        [[0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 9.0, 9.0]] * 4
    )  # a padded head: 8 columns
    params = [
        SamplingParams(temperature=0, logit_bias={4: 3.0}),  # 4 overtakes 1
        SamplingParams(temperature=0),  # untouched
        SamplingParams(
            temperature=0, min_tokens=1, stop_token_ids=[4], logit_bias={4: 50.0}, logprobs=2
        ),
        SamplingParams(temperature=0.7, seed=3, logit_bias={5: 100.0}),
    ]  # sampled: 5 all but surely
    batch = make_batch(params, vocab)
    assert (batch.bias_rows.tolist(), batch.bias_ids.tolist()) == ([0, 2, 3], [4, 4, 5])
    out = Sampler(fused=False)(logits, batch)
    assert out.token_ids.tolist() == [4, 1, 1, 5]
    # row 2: the bias reached id 4, min_tokens masked it: -inf; the rest is log_softmax of the unbiased row
    want = torch.log_softmax(torch.tensor([0.0, 2.0, 1.0, 0.0, NEG_INF, 0.0]), 0)
    assert out.top_token_ids[2].tolist() == [1, 2]
    torch.testing.assert_close(out.top_logprobs[2], want[[1, 2]])
    biased = Sampler(fused=False)(
        logits[:1],
        make_batch([SamplingParams(temperature=0, logprobs=1, logit_bias={2: 1.5})], vocab),
    )
    torch.testing.assert_close(
        biased.logprobs, torch.log_softmax(torch.tensor([0.0, 2, 2.5, 0, 0, 0]), 0)[[2]]
    )


def test_logit_bias_is_checked_by_sampling_params():
    for bad in ({-1: 1.0}, {"3": 1.0}, {3: float("nan")}, {3: "up"}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={3: -2}).logit_bias == {3: -2}
