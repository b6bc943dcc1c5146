"""Greedy ids and log-probs of mmserve vs transformers on tiny random LLaVA checkpoints.

Covers one request, continuous batching with requests arriving at different steps, prefix-cache
hits, chunked prefill cutting through image tokens, and preemption under a tiny KV pool.
"""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from tests.parity.hf_oracle import check_against_hf, hf_greedy, run_staggered

N = 32
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _prompt(i: int, num_images: int) -> dict:
    words = " ".join(["tell me about it"] * (i % 4 + 1))
    tags = "".join("<image>\n" for _ in range(num_images))
    return {
        "prompt": f"USER: {tags}{words} number {i} ASSISTANT:",
        "images": [make_test_image(10 * i + k) for k in range(num_images)],
    }


def _check(model_dir: str, prompt: dict, out, device: str) -> None:
    # GPU kernels sum in a different order than the oracle's, hence the looser bound there
    check_against_hf(model_dir, prompt, out, N, device)


@pytest.mark.parametrize("device", DEVICES)
def test_single_request_matches_transformers(tiny_llava_dir, device):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32")
    prompt = _prompt(0, 1)
    _check(tiny_llava_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_mha_full_features_config_matches_transformers(tiny_llava_mha_dir, device):
    llm = LLM(tiny_llava_mha_dir, device=device, dtype="float32")
    for prompt in (_prompt(1, 1), _prompt(2, 2)):
        _check(tiny_llava_mha_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_with_staggered_arrivals_matches_single_requests(tiny_llava_dir, device):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    prompts = [_prompt(i, i % 4) for i in range(8)]
    outs = run_staggered(engine, prompts, GREEDY)
    assert not engine.scheduler.running and not engine.scheduler.waiting
    for prompt, out in zip(prompts, outs):
        _check(tiny_llava_dir, prompt, out, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_image_and_prefix_hits_the_prefix_cache(tiny_llava_dir, device):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", block_size=4)
    prompt = _prompt(3, 1)
    first = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    # same picture, sent as a fresh object, with the same prefix: the image blocks are reused
    second_prompt = {"prompt": prompt["prompt"], "images": [make_test_image(30)]}
    second = llm.generate([second_prompt], GREEDY)[0]
    assert second.metrics.num_cached_tokens >= 16
    assert llm.engine.kv.stats.hit_tokens >= 16
    _check(tiny_llava_dir, second_prompt, second, device)
    # a different image behind the same text must not hit beyond the text before the image
    other = {"prompt": prompt["prompt"], "images": [make_test_image(99)]}
    third = llm.generate([other], GREEDY)[0]
    image_offset = third.prompt_token_ids.index(llm.engine.inputs.image_token_id)
    assert third.metrics.num_cached_tokens <= image_offset
    _check(tiny_llava_dir, other, third, device)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_splitting_image_tokens_matches(tiny_llava_dir, device):
    llm = LLM(
        tiny_llava_dir,
        device=device,
        dtype="float32",
        max_num_batched_tokens=5,
        enable_prefix_caching=False,
    )
    prompt = _prompt(4, 2)
    out_ids = llm.engine.inputs.process(prompt).prompt_token_ids
    image_pos = [i for i, t in enumerate(out_ids) if t == llm.engine.inputs.image_token_id]
    # some 5-token chunk boundary falls strictly inside an image's run of placeholder tokens
    assert any(p % 5 == 0 and p - 1 in image_pos for p in image_pos)
    _check(tiny_llava_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_under_tiny_kv_pool_matches(tiny_llava_dir, device):
    llm = LLM(
        tiny_llava_dir,
        device=device,
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        enable_prefix_caching=False,
    )
    prompts = [_prompt(i, 1) for i in range(4)]
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        _check(tiny_llava_dir, prompt, out, device)
    assert llm.engine.kv.pool.num_free == 40


def test_half_precision_runs_close_to_fp32(tiny_llava_dir):
    """bf16 on CPU: not bit-exact, but the first greedy tokens agree with the fp32 oracle."""
    llm = LLM(tiny_llava_dir, device="cpu", dtype="bfloat16")
    prompt = _prompt(5, 1)
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    _, ref, _ = hf_greedy(tiny_llava_dir, prompt["prompt"], prompt["images"], 4)
    assert out.outputs[0].token_ids[0] == ref[0]
    assert llm.engine.model.language_model.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
def test_context_and_generation_logits_match_transformers(tiny_llava_dir, device):
    """Triton's return_context_logits / return_generation_logits: fp32 logits of every prompt position and
    every generated step, also when the prompt is prefilled in chunks (one cut inside the image)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    llm = LLM(tiny_llava_dir, device=device, dtype="float32", max_num_batched_tokens=7)
    prompt = _prompt(6, 1)
    params = SamplingParams(
        max_tokens=6,
        min_tokens=6,
        temperature=0.0,
        return_context_logits=True,
        return_generation_logits=True,
    )
    out = llm.generate([prompt, prompt], params, use_tqdm=False)[
        1
    ]  # the 2nd would hit the cache: it must not
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    hf = (
        LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32)
        .to(device)
        .eval()
    )
    kw = {"device": device} if device != "cpu" else {}
    enc = processor(text=prompt["prompt"], images=prompt["images"], return_tensors="pt", **kw).to(
        device
    )
    with torch.no_grad():
        ref_context = hf(**enc).logits[0].float().cpu()
        gen = hf.generate(
            **enc,
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_generation = torch.stack(gen.logits)[:, 0].float().cpu()
    assert out.metrics.num_cached_tokens == 0
    assert (
        out.context_logits.shape
        == ref_context.shape
        == (len(out.prompt_token_ids), ref_context.shape[1])
    )
    assert out.generation_logits.shape == ref_generation.shape
    tol = 1e-3 if device == "cpu" else 2e-2
    torch.testing.assert_close(out.context_logits, ref_context, atol=tol, rtol=tol)
    torch.testing.assert_close(out.generation_logits, ref_generation, atol=tol, rtol=tol)


def test_context_logits_survive_preemption_without_duplicates(tiny_llava_dir):
    llm = LLM(
        tiny_llava_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=40,
        enable_prefix_caching=False,
    )
    params = SamplingParams(
        max_tokens=32, min_tokens=32, temperature=0.0, return_context_logits=True
    )
    prompts = [_prompt(i, 1) for i in range(4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        assert out.context_logits.shape[0] == len(out.prompt_token_ids)
    # the latest arrival is preempted first; its logits equal those of a run without preemption
    single = LLM(tiny_llava_dir, device="cpu", dtype="float32", enable_prefix_caching=False)
    ref = single.generate(prompts[3:], params, use_tqdm=False)[0]
    torch.testing.assert_close(outs[3].context_logits, ref.context_logits, atol=1e-4, rtol=1e-4)
