"""The sampler queues its work without host syncs on the GPU (async scheduling depends on it)."""
from __future__ import annotations

import pytest
import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import Sampler, SamplingBatch

pytestmark = pytest.mark.gpu


def test_masking_min_tokens_and_bad_words_makes_no_host_sync():
    """Rows with min_tokens (EOS and stop ids masked) and bad words: CUDA's sync debug mode raises on any
    synchronizing call (a pageable copy, .item(), a stream sync) while the sampler runs; masked ids never win."""
    device = torch.device("cuda")
    vocab = 64
    params = [SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, bad_words=["x"]), SamplingParams(temperature=0.0)]
    logits = torch.zeros(3, vocab, device=device)
    logits[:, 2] = 10.0     # EOS of row 0 would win
    logits[:, 5] = 9.0      # then its stop id
    logits[1, 7] = 20.0     # row 1's banned id would win
    batch = SamplingBatch.build(params, [[1, 3]] * 3, [[3]] * 3, [None] * 3, [2, None, None], [[], [[7]], []],
                                vocab, device)
    assert batch.mask_rows is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.token_ids.tolist()
    assert tokens[0] not in (2, 5) and tokens[1] != 7 and tokens[2] == 2


def test_random_sampling_with_filters_logprobs_and_seeds_makes_no_host_sync():
    device = torch.device("cuda")
    vocab = 64
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, logprobs=3, seed=1),
              SamplingParams(temperature=1.0, top_p=0.5, logprobs=3), SamplingParams(temperature=0.0, logprobs=3)]
    logits = torch.randn(3, vocab, device=device, generator=torch.Generator(device).manual_seed(0))
    gens = [torch.Generator(device).manual_seed(1), None, None]
    batch = SamplingBatch.build(params, [[1]] * 3, [[2]] * 3, gens, [None] * 3, [[]] * 3, vocab, device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits.clone(), batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = out.token_ids.tolist()
    assert tokens[0] in logits[0].topk(5).indices.tolist() and tokens[2] == int(logits[2].argmax())
    assert out.top_token_ids.shape == (3, 3)
