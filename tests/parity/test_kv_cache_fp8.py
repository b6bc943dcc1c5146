"""FP8 (e4m3) KV cache: logits match transformers with its keys/values rounded to e4m3 the same way, the pool
holds more tokens in the same memory, and prefix-cache hits still reuse blocks."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.attention.kv_quant import quantize_kv
from mmserve.config import CacheConfig
from tests.parity.fp8_case import DEVICES, FP8, PARAMS, PROMPT
from tests.parity.hf_oracle import hf_logits


def _round_to_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return quantize_kv(x, FP8, scale).to(x.dtype) * scale


def _hf_logits(
    model_dir: str,
    device: str,
    monkeypatch: pytest.MonkeyPatch | None,
    scales: dict[int, tuple[float, float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' context and generation logits; with monkeypatch, every key (after rotary) and value is
    rounded to e4m3 with its layer's (k, v) scale (default 1) as it enters the cache: the arithmetic of an
    FP8 KV cache."""
    from transformers import DynamicCache

    if monkeypatch is not None:
        update = DynamicCache.update

        def rounded_update(self, key_states, value_states, layer_idx, *args, **kwargs):
            ks, vs = (scales or {}).get(layer_idx, (1.0, 1.0))
            return update(
                self,
                _round_to_fp8(key_states, ks),
                _round_to_fp8(value_states, vs),
                layer_idx,
                *args,
                **kwargs,
            )

        monkeypatch.setattr(DynamicCache, "update", rounded_update)
    return hf_logits(model_dir, PROMPT, PARAMS.max_tokens, device)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_kv_cache_matches_transformers_with_fp8_rounded_keys_and_values(
    tiny_llava_dir, device, monkeypatch
):
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
        llm = LLM(
            tiny_llava_dir,
            device="cpu",
            dtype="float32",
            kv_cache_dtype=kv_dtype,
            kv_cache_size_gb=0.01,
        )
        runner = llm.engine.runner
        sizes[kv_dtype] = (
            llm.engine.kv.num_blocks,
            runner.kv_bytes_per_block(),
            sum(c.numel() * c.element_size() for c in runner.kv_caches),
        )
    (blocks32, per_block32, bytes32), (blocks8, per_block8, bytes8) = sizes["auto"], sizes["fp8"]
    assert per_block32 == 4 * per_block8  # fp32 -> 1 byte per element
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


@pytest.mark.parametrize("device", DEVICES)
def test_kv_scales_from_the_checkpoint_are_used(tiny_llava_dir, tmp_path, monkeypatch, device):
    """k_scale / v_scale / kv_scale tensors (also under k_proj / v_proj, per-head -> max) set each layer's
    scales; logits match transformers rounding with those scales; a model-dtype cache ignores them."""
    import shutil

    from safetensors.torch import save_file

    model_dir = tmp_path / "scaled"
    shutil.copytree(tiny_llava_dir, model_dir)
    prefix = "language_model.model.layers.{}.self_attn."
    save_file(
        {
            prefix.format(0) + "k_scale": torch.tensor(0.05),
            prefix.format(0) + "v_scale": torch.tensor(0.02),
            prefix.format(1) + "kv_scale": torch.tensor([0.03]),
            prefix.format(2) + "k_proj.k_scale": torch.tensor(0.04),
            prefix.format(2) + "v_proj.v_scale": torch.tensor([0.01, 0.06]),
        },
        str(model_dir / "kv_scales.safetensors"),
    )
    scales = {0: (0.05, 0.02), 1: (0.03, 0.03), 2: (0.04, 0.06)}

    llm = LLM(str(model_dir), device=device, dtype="float32", kv_cache_dtype="fp8")
    layers = llm.engine.runner.attn_layers
    got = {i: (a.k_scale, a.v_scale) for i, a in enumerate(layers)}
    assert got == {i: pytest.approx(scales.get(i, (1.0, 1.0))) for i in range(len(layers))}
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    unscaled_context, _ = _hf_logits(str(model_dir), device, None)
    context, generation = _hf_logits(str(model_dir), device, monkeypatch, scales)
    tol = 2e-3 if device == "cpu" else 2e-2
    torch.testing.assert_close(out.context_logits, context, atol=tol, rtol=tol)
    torch.testing.assert_close(out.generation_logits, generation, atol=tol, rtol=tol)
    assert (out.context_logits - unscaled_context).abs().max() > 20 * tol
    del llm

    fp32 = LLM(str(model_dir), device=device, dtype="float32").generate(
        [PROMPT], PARAMS, use_tqdm=False
    )[0]
    torch.testing.assert_close(fp32.context_logits, unscaled_context, atol=tol, rtol=tol)
