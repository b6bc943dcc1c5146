"""FP8 (e4m3) KV cache: logits match transformers with its keys/values rounded to e4m3 the same way, the pool
holds more tokens in the same memory, and prefix-cache hits still reuse blocks."""
from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.attention.kv_quant import quantize_kv
from mmserve.config import CacheConfig
from mmserve.testing import make_test_image

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
FP8 = torch.float8_e4m3fn
PROMPT = {"prompt": "USER: <image>\ntell me about it tell me about it number 3 ASSISTANT:",
          "images": [make_test_image(3)]}
PARAMS = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, return_context_logits=True,
                        return_generation_logits=True)


def _round_to_fp8(x: torch.Tensor) -> torch.Tensor:
    return quantize_kv(x, FP8).to(x.dtype)


def _hf_logits(model_dir: str, device: str, monkeypatch: pytest.MonkeyPatch | None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' context and generation logits; with monkeypatch, every key (after rotary) and value is
    rounded to e4m3 before it enters the cache: the arithmetic of an FP8 KV cache with scale 1."""
    import transformers.models.llama.modeling_llama as llama
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    hooks = []
    if monkeypatch is not None:
        rotary = llama.apply_rotary_pos_emb

        def rotary_then_round(q, k, cos, sin, *args, **kwargs):
            q, k = rotary(q, k, cos, sin, *args, **kwargs)
            return q, _round_to_fp8(k)

        monkeypatch.setattr(llama, "apply_rotary_pos_emb", rotary_then_round)
        for layer in model.model.language_model.layers:
            hooks.append(layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: _round_to_fp8(out)))
    processor = AutoProcessor.from_pretrained(model_dir)
    kw = {"device": device} if device != "cpu" else {}
    enc = processor(text=PROMPT["prompt"], images=PROMPT["images"], return_tensors="pt", **kw).to(device)
    try:
        with torch.no_grad():
            context = model(**enc).logits[0].float().cpu()
            gen = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    finally:
        for h in hooks:
            h.remove()
    return context, torch.stack(gen.logits)[:, 0].float().cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_kv_cache_matches_transformers_with_fp8_rounded_keys_and_values(tiny_llava_dir, device, monkeypatch):
    llm = LLM(tiny_llava_dir, device=device, dtype="float32", kv_cache_dtype="fp8")
    assert all(c.dtype == FP8 for c in llm.engine.runner.kv_caches)
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    plain_context, _ = _hf_logits(tiny_llava_dir, device, None)
    context, generation = _hf_logits(tiny_llava_dir, device, monkeypatch)
    tol = 2e-3 if device == "cpu" else 2e-2
    torch.testing.assert_close(out.context_logits, context, atol=tol, rtol=tol)
    torch.testing.assert_close(out.generation_logits, generation, atol=tol, rtol=tol)
    # the rounding is really there: unrounded transformers is far outside the tolerance
    assert (out.context_logits - plain_context).abs().max() > 20 * tol
    assert llm.engine.kv.usage == 0


def test_fp8_pool_holds_more_tokens_in_the_same_memory(tiny_llava_dir):
    sizes = {}
    for kv_dtype in ("auto", "fp8"):
        llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", kv_cache_dtype=kv_dtype, kv_cache_size_gb=0.01)
        runner = llm.engine.runner
        sizes[kv_dtype] = (llm.engine.kv.num_blocks, runner.kv_bytes_per_block(),
                           sum(c.numel() * c.element_size() for c in runner.kv_caches))
    (blocks32, per_block32, bytes32), (blocks8, per_block8, bytes8) = sizes["auto"], sizes["fp8"]
    assert per_block32 == 4 * per_block8                  # fp32 -> 1 byte per element
    assert blocks8 == 4 * blocks32 or abs(blocks8 - 4 * blocks32) <= 4
    assert abs(bytes8 - bytes32) <= 4 * per_block8 and bytes8 <= 0.01 * 2**30


def test_fp8_prefix_cache_hit_reuses_blocks_and_gives_the_same_tokens(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    first, second = (llm.generate([PROMPT], params, use_tqdm=False)[0] for _ in range(2))
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens >= len(second.prompt_token_ids) - 8
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").cache_dtype(torch.float16) == FP8
    assert CacheConfig().cache_dtype(torch.bfloat16) == torch.bfloat16
