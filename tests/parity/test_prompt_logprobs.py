"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers: every prompt token's log-probability
given the ones before it, and the top-k, equal the fp32 oracle's log-softmax of its context logits, with a
picture in the prompt, across chunked prefill, and on a repeat of a cached prompt (computed again, not skipped)."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from tests.parity.hf_oracle import TOL, hf_logits

PROMPT = {
    "prompt": "USER: <image>\nWhat is in the picture? Tell me in detail. ASSISTANT:",
    "images": [make_test_image(9)],
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _check(out, oracle_lp: torch.Tensor, k: int, tol: float) -> None:
    """Position p's entry: the prompt token's logprob and rank, and the k likeliest ids (rank <= k), all as the
    oracle's log-softmax of the logits at position p - 1."""
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        entry, ref = out.prompt_logprobs[pos], oracle_lp[pos - 1]
        chosen = entry[ids[pos]]
        assert chosen.logprob == pytest.approx(ref[ids[pos]].item(), abs=tol)
        if tol <= TOL["cpu"]:  # the GPU's summation order may swap near-equal neighbours
            assert chosen.rank == int((ref > ref[ids[pos]]).sum()) + 1
        top = {tok: lp for tok, lp in entry.items() if lp.rank <= k}
        assert len(top) == k, (pos, entry)
        for tok, lp in top.items():
            assert lp.logprob == pytest.approx(ref[tok].item(), abs=tol), (
                pos,
                tok,
                lp,
                ref[tok].item(),
                ref.topk(k + 2),
                entry,
            )
        if tol <= TOL["cpu"]:
            assert set(top) == set(ref.topk(k).indices.tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [2048, 96], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_transformers(tiny_llava_dir, chunk, device):
    context, _ = hf_logits(tiny_llava_dir, PROMPT, 1)
    oracle_lp = torch.log_softmax(context.double(), dim=-1).float()
    # Pictures are preprocessed on the CPU, as the oracle's are: the tiny random model turns the GPU resize's
    # last-bit pixel differences into ~0.05 of log-probability at the image's positions (so does transformers'
    # own GPU run against its CPU one: up to 0.12, with cuDNN's TF32 patch embedding).
    llm = LLM(
        tiny_llava_dir,
        device=device,
        dtype="float32",
        max_num_batched_tokens=chunk,
        preprocess_on_gpu=False,
    )
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    first = llm.generate(PROMPT, params, use_tqdm=False)[0]
    _check(first, oracle_lp, 3, TOL[device])
    again = llm.generate(PROMPT, params, use_tqdm=False)[
        0
    ]  # its blocks are cached: computed again anyway
    assert [
        e and {t: round(lp.logprob, 5) for t, lp in e.items()} for e in again.prompt_logprobs
    ] == [e and {t: round(lp.logprob, 5) for t, lp in e.items()} for e in first.prompt_logprobs]
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert (
        plain.prompt_logprobs is None and plain.outputs[0].token_ids == first.outputs[0].token_ids
    )
    assert llm.engine.kv.usage == 0
