"""The sampler queues its work without host syncs on the GPU (async scheduling depends on it)."""

from __future__ import annotations

import pytest
import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import Sampler, SamplerOutput
from mmserve.worker.sampling_batch import SamplingBatch

pytestmark = pytest.mark.gpu


def sample_without_sync(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Sampler()(logits, batch) in CUDA's sync debug mode, which raises on any synchronizing call (a pageable
    copy, .item(), a stream sync)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_masking_min_tokens_and_bad_words_makes_no_host_sync():
    """Rows with min_tokens (EOS and stop ids masked) and bad words: CUDA's sync debug mode raises on any
    synchronizing call (a pageable copy, .item(), a stream sync) while the sampler runs; masked ids never win."""
    device = torch.device("cuda")
    vocab = 64
    params = [
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, bad_words=["x"]),
        SamplingParams(temperature=0.0),
    ]
    logits = torch.zeros(3, vocab, device=device)
    logits[:, 2] = 10.0  # EOS of row 0 would win
    logits[:, 5] = 9.0  # then its stop id
    logits[1, 7] = 20.0  # row 1's banned id would win
    batch = SamplingBatch.build(
        params, [[1, 3]] * 3, [[3]] * 3, [None] * 3, [2, None, None], [[], [[7]], []], vocab, device
    )
    assert batch.mask_rows is not None
    out = sample_without_sync(logits, batch)
    tokens = out.token_ids.tolist()
    assert tokens[0] not in (2, 5) and tokens[1] != 7 and tokens[2] == 2


def test_random_sampling_with_filters_logprobs_and_seeds_makes_no_host_sync():
    device = torch.device("cuda")
    vocab = 64
    params = [
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=3, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=3),
    ]
    logits = torch.randn(3, vocab, device=device, generator=torch.Generator(device).manual_seed(0))
    gens = [torch.Generator(device).manual_seed(1), None, None]
    batch = SamplingBatch.build(
        params, [[1]] * 3, [[2]] * 3, gens, [None] * 3, [[]] * 3, vocab, device
    )
    out = sample_without_sync(logits.clone(), batch)
    tokens = out.token_ids.tolist()
    assert tokens[0] in logits[0].topk(5).indices.tolist() and tokens[2] == int(logits[2].argmax())
    assert out.top_token_ids.shape == (3, 3)


def test_fused_sampling_follows_the_torch_distribution_at_real_vocab_sizes():
    """The Triton sampler's draws (4x10^4 per case, bf16 logits with a padded lm_head) pass a chi-square test
    against the torch sampler's exact distribution, at Vicuna's and Qwen2's vocabulary sizes."""
    from tests.kernels.sampling_checks import (
        SAMPLING_CASES,
        assert_draws_follow,
        draws_for_cases,
        reference_probs,
    )

    cases = SAMPLING_CASES + [(0.8, 50, 0.9, 0.0), (1.0, 0, 0.95, 0.02)]
    for vocab in (32064, 152064):
        gen = torch.Generator().manual_seed(vocab)
        logits = (torch.randn(vocab, generator=gen) * 2.5).to(torch.bfloat16).float()
        draws = draws_for_cases(
            logits, cases, 40_000, torch.device("cuda"), dtype=torch.bfloat16, padded=64
        )
        for case, got in zip(cases, draws):
            assert_draws_follow(got, reference_probs(logits, *case), f"V={vocab} case {case}")


def test_fused_sampler_reads_bf16_logits_as_they_are_without_a_host_sync():
    """Sampling rows without penalties, masks or logprobs go straight to the kernel on the model's bf16 logits
    (no fp32 copy); no host sync; every row's id lies in its filtered set; padded columns never win."""
    device = torch.device("cuda")
    vocab = 1000
    params = [
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, min_p=0.5, seed=5),
    ]
    gen = torch.Generator(device).manual_seed(0)
    logits = (torch.randn(4, vocab + 24, device=device, generator=gen) * 3).to(torch.bfloat16)
    logits[:, vocab:] = 1e4
    batch = SamplingBatch.build(
        params, [[1]] * 4, [[2]] * 4, [None] * 4, [None] * 4, [[]] * 4, vocab, device
    )
    out = sample_without_sync(logits, batch)
    tokens = out.token_ids.tolist()
    real = logits[:, :vocab].float()
    assert tokens[0] in real[0].topk(3).indices.tolist()
    probs = real[1].softmax(-1)
    top = probs.sort(descending=True)
    allowed = top.indices[: int((top.values.cumsum(0) < 0.5).sum()) + 1].tolist()
    assert tokens[1] in allowed
    assert tokens[2] == int(real[2].argmax())
    assert real[3, tokens[3]] >= real[3].max() + 1.2 * torch.log(torch.tensor(0.5))


def test_seeded_request_draws_the_same_ids_wherever_it_sits_in_the_batch():
    """A seeded request's fused draw depends on its seed and output position, not on its row or neighbours."""
    device = torch.device("cuda")
    vocab = 5000
    logits = torch.randn(vocab, device=device, generator=torch.Generator(device).manual_seed(1))
    seeded = SamplingParams(temperature=1.5, seed=1234)
    picks = []
    for rows, at in ((1, 0), (5, 3), (9, 8)):
        params = [SamplingParams(temperature=1.5) for _ in range(rows)]
        params[at] = seeded
        batch = SamplingBatch.build(
            params,
            [[1]] * rows,
            [[2, 3]] * rows,
            [None] * rows,
            [None] * rows,
            [[]] * rows,
            vocab,
            device,
        )
        picks.append(int(Sampler()(logits.expand(rows, vocab), batch).token_ids[at]))
    assert len(set(picks)) == 1, picks
    later = SamplingBatch.build([seeded], [[1]], [[2, 3, 4]], [None], [None], [[]], vocab, device)
    draws = {int(Sampler()(logits.expand(1, vocab), later).token_ids[0])}
    for pos in range(4, 40):
        batch = SamplingBatch.build(
            [seeded], [[1]], [[2] * pos], [None], [None], [[]], vocab, device
        )
        draws.add(int(Sampler()(logits.expand(1, vocab), batch).token_ids[0]))
    assert len(draws) > 10, "output positions must draw fresh noise"


def _compiled_sampler_variants() -> int:
    from mmserve.kernels import sampling

    # JITFunction.device_caches: per device a tuple whose first element maps specialization keys to kernels
    return sum(len(entry[0]) for entry in sampling._sample_kernel.device_caches.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_warm_up_compiles_every_variant_a_serving_step_launches(dtype):
    """After Sampler.warm_up on one row as the LM head returns it, batches with any mix of parameters (greedy
    and sampled rows, temperature, top-k, top-p, min-p, seeds, penalties and logprobs, which sample fp32
    logits) launch the fused kernel without compiling it again: the kernel takes which per-row tensors it has
    as a runtime bit set. Before, each mix was its own variant, compiled on first use (0.7 s mid-serving)."""
    device = torch.device("cuda")
    vocab, width = 32000, 32064  # a padded LM head
    logits = torch.randn(8, width, device=device).to(dtype)
    sampler = Sampler()
    sampler.warm_up(logits[:1].clone(), vocab)
    compiled = _compiled_sampler_variants()
    assert compiled >= 2, compiled  # the head's dtype and fp32
    mixes = [
        [SamplingParams(temperature=0.7)],
        [SamplingParams(top_k=40), SamplingParams(temperature=0.0, logprobs=2)],
        [
            SamplingParams(top_p=0.8, seed=3),
            SamplingParams(min_p=0.1),
            SamplingParams(temperature=0.0),
        ],
        [SamplingParams(temperature=1.3, top_k=5, top_p=0.95, min_p=0.02, presence_penalty=0.5)],
        [
            SamplingParams(temperature=0.9, logprobs=3),
            SamplingParams(top_p=0.5, frequency_penalty=0.2),
        ],
    ]
    for params in mixes:
        n = len(params)
        batch = SamplingBatch.build(
            params, [[1, 2]] * n, [[3]] * n, [None] * n, [None] * n, [[]] * n, vocab, device
        )
        ids = sampler(logits[:n].clone(), batch).token_ids
        assert ids.shape == (n,) and bool((ids < vocab).all()), (params, ids)
    torch.cuda.synchronize()
    assert _compiled_sampler_variants() == compiled, (
        "a parameter mix compiled a new sampler variant"
    )
