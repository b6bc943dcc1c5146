"""KV pool sizing in ModelRunner: bytes per block from the text model's attention shapes and the KV dtype,
the block count (fixed, kv_cache_size_gb on CPU, free GPU memory x kv_cache_memory_fraction on CUDA) and the
activation profile that is subtracted from free memory first.

The CUDA sizing rule is exercised on CPU by giving a real runner a CUDA device and a fixed answer from
torch.cuda.mem_get_info (the only thing it reads from the GPU); profile_peak_activation_bytes is CUDA-only
(it returns 0 on CPU), so its real measurement is a `gpu` test.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmserve import LLM
from mmserve.config import CacheConfig
from mmserve.models.loader import build_model, load_hf_config, text_config_of
from mmserve.worker.model_runner import ModelRunner

FP8 = torch.float8_e4m3fn
ELEMENT_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, FP8: 1}
GiB = 2**30


def _build(model_dir: str, dtype: torch.dtype, device: str = "cpu"):
    hf = load_hf_config(model_dir)
    text = text_config_of(hf)
    return build_model(model_dir, hf, torch.device(device), dtype), text


def _runner(model, text, dtype: torch.dtype, device: str = "cpu", **cache_kw) -> ModelRunner:
    backend = "torch" if device == "cpu" else "auto"
    return ModelRunner(
        model, torch.device(device), dtype, CacheConfig(**cache_kw), text.vocab_size, backend
    )


def _hand_bytes_per_block(text, block_size: int, kv_dtype: torch.dtype) -> int:
    """K and V, block_size tokens, every KV head's head_dim, every decoder layer: from the HF config alone."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return (
        2
        * block_size
        * text.num_key_value_heads
        * head_dim
        * ELEMENT_BYTES[kv_dtype]
        * text.num_hidden_layers
    )


@pytest.fixture(scope="module")
def fp32_model(tiny_llava_dir):
    return _build(tiny_llava_dir, torch.float32)


def _fake_cuda(monkeypatch, runner: ModelRunner, free: int) -> None:
    """Take num_blocks_for down its CUDA branch on a CPU machine: the runner's device says cuda and the GPU
    reports `free` bytes free (no other CUDA call is made by that branch)."""
    monkeypatch.setattr(runner, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))


# ---- bytes per block -----------------------------------------------------------------------------


@pytest.mark.parametrize("model_fixture", ["tiny_llava_dir", "tiny_llava_mha_dir"])
@pytest.mark.parametrize(
    "dtype,kv_cache_dtype,kv_dtype",
    [
        (torch.float32, "auto", torch.float32),
        (torch.bfloat16, "auto", torch.bfloat16),
        (torch.float16, "auto", torch.float16),
        (torch.float32, "fp8", FP8),
        (torch.bfloat16, "fp8_e4m3", FP8),
    ],
    ids=["fp32", "bf16", "fp16", "fp32-kv-fp8", "bf16-kv-fp8_e4m3"],
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_bytes_per_block_matches_hand_computation_and_the_allocation(
    request, model_fixture, dtype, kv_cache_dtype, kv_dtype, block_size
):
    model, text = _build(request.getfixturevalue(model_fixture), dtype)
    runner = _runner(model, text, dtype, block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    expected = _hand_bytes_per_block(text, block_size, kv_dtype)
    assert runner.kv_dtype == kv_dtype
    assert runner.kv_bytes_per_block() == expected
    # the formula is what the pool really takes: one cache per decoder layer (none for the vision tower)
    runner.allocate_kv_cache(7)
    assert len(runner.kv_caches) == text.num_hidden_layers
    assert all(c.dtype == kv_dtype for c in runner.kv_caches)
    assert sum(c.untyped_storage().nbytes() for c in runner.kv_caches) == 7 * expected


def test_hand_numbers_of_the_tiny_presets(tiny_llava_dir, tiny_llava_mha_dir):
    """Pin the arithmetic itself once: tiny = 3 layers x 2 KV heads x head_dim 20; tiny-mha has 4 KV heads."""
    for model_dir, kv_heads in ((tiny_llava_dir, 2), (tiny_llava_mha_dir, 4)):
        model, text = _build(model_dir, torch.float32)
        fp32 = _runner(model, text, torch.float32).kv_bytes_per_block()
        fp8 = _runner(model, text, torch.float32, kv_cache_dtype="fp8").kv_bytes_per_block()
        assert fp32 == 2 * 16 * kv_heads * 20 * 4 * 3
        assert fp8 * 4 == fp32


# ---- block count ------------------------------------------------------------------------------------


def test_fixed_num_blocks_wins_over_both_sizing_rules(fp32_model, monkeypatch):
    model, text = fp32_model
    runner = _runner(
        model, text, torch.float32, num_blocks=7, kv_cache_size_gb=0.5, kv_cache_memory_fraction=0.1
    )
    assert runner.num_blocks_for(CacheConfig(num_blocks=7, kv_cache_size_gb=0.5)) == 7
    _fake_cuda(monkeypatch, runner, free=40 * GiB)
    assert (
        runner.num_blocks_for(
            CacheConfig(num_blocks=7, kv_cache_memory_fraction=0.1), activation_peak=GiB
        )
        == 7
    )


@pytest.mark.parametrize("size_gb", [0.01, 0.25, 1.0])
def test_cpu_pool_is_kv_cache_size_gb_over_bytes_per_block_and_ignores_the_fraction(
    fp32_model, size_gb
):
    model, text = fp32_model
    runner = _runner(model, text, torch.float32, block_size=8)
    per_block = _hand_bytes_per_block(text, 8, torch.float32)
    expected = math.floor(size_gb * GiB / per_block)
    for fraction in (0.05, 0.9, 1.0):
        cfg = CacheConfig(block_size=8, kv_cache_size_gb=size_gb, kv_cache_memory_fraction=fraction)
        assert runner.num_blocks_for(cfg, activation_peak=0) == expected
    assert expected * per_block <= size_gb * GiB < (expected + 1) * per_block


@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("peak", [0, 3 * GiB + 12345])
def test_gpu_pool_is_the_fraction_of_free_memory_after_the_activation_peak(
    fp32_model, monkeypatch, fraction, peak
):
    model, text = fp32_model
    runner = _runner(model, text, torch.float32, kv_cache_dtype="fp8")
    free = 20 * GiB + 777
    _fake_cuda(monkeypatch, runner, free)
    per_block = _hand_bytes_per_block(text, 16, FP8)
    blocks = runner.num_blocks_for(
        CacheConfig(
            kv_cache_memory_fraction=fraction, kv_cache_size_gb=0.001, kv_cache_dtype="fp8"
        ),
        activation_peak=peak,
    )
    assert blocks == math.floor((free - peak) * fraction / per_block)
    # the pool fits the budget, and one more block would not
    assert blocks * per_block <= (free - peak) * fraction < (blocks + 1) * per_block


def test_gpu_pool_grows_with_the_fraction_and_shrinks_with_the_peak(fp32_model, monkeypatch):
    model, text = fp32_model
    runner = _runner(model, text, torch.float32)
    _fake_cuda(monkeypatch, runner, free=8 * GiB)
    by_fraction = [
        runner.num_blocks_for(CacheConfig(kv_cache_memory_fraction=f)) for f in (0.1, 0.2, 0.4, 0.8)
    ]
    assert by_fraction == sorted(by_fraction) and len(set(by_fraction)) == 4
    assert abs(by_fraction[3] - 8 * by_fraction[0]) <= 8  # proportional, up to flooring
    by_peak = [
        runner.num_blocks_for(CacheConfig(kv_cache_memory_fraction=0.5), activation_peak=p)
        for p in (0, GiB, 4 * GiB)
    ]
    assert by_peak[0] > by_peak[1] > by_peak[2]
    assert abs(by_peak[2] - by_peak[0] / 2) <= 1  # half the free memory went to activations


def test_too_small_budget_fails_at_startup_naming_the_memory_and_the_knob(fp32_model, monkeypatch):
    """A budget below two blocks, or an activation peak above the free memory, is an error when the pool is
    sized (at startup), naming where the budget came from; not a pool too small for any real prompt."""
    model, text = fp32_model
    runner = _runner(model, text, torch.float32)
    per_block = runner.kv_bytes_per_block()
    _fake_cuda(monkeypatch, runner, free=3 * per_block)
    assert runner.num_blocks_for(CacheConfig(kv_cache_memory_fraction=0.9)) == 2  # 2.7 blocks: fits
    with pytest.raises(ValueError, match="kv_cache_memory_fraction 0.3"):
        runner.num_blocks_for(CacheConfig(kv_cache_memory_fraction=0.3))  # 0.9 blocks of budget
    with pytest.raises(ValueError, match="activation peak"):
        runner.num_blocks_for(CacheConfig(), activation_peak=10 * per_block)  # peak > free
    _fake_cuda(monkeypatch, runner, free=0)
    with pytest.raises(ValueError, match="0 blocks"):
        runner.num_blocks_for(CacheConfig())
    cpu = _runner(model, text, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_size_gb"):
        cpu.num_blocks_for(CacheConfig(kv_cache_size_gb=per_block / GiB / 10))  # a tenth of a block


def test_config_rejects_out_of_range_fraction_and_size():
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
            CacheConfig(kv_cache_memory_fraction=bad)
    with pytest.raises(ValueError, match="kv_cache_size_gb"):
        CacheConfig(kv_cache_size_gb=0)
    with pytest.raises(ValueError, match="num_blocks"):
        CacheConfig(num_blocks=1)


def test_engine_on_cpu_allocates_the_hand_computed_pool(tiny_llava_dir):
    """End to end through LLM -> Engine: the profile is 0 on CPU, so the pool depends only on kv_cache_size_gb
    (not on max_num_batched_tokens or the fraction), and the allocated tensors are exactly that many blocks."""
    hf = load_hf_config(tiny_llava_dir)
    per_block = _hand_bytes_per_block(text_config_of(hf), 8, torch.float32)
    expected = math.floor(0.01 * GiB / per_block)
    for tokens, fraction in ((64, 0.9), (512, 0.2)):
        llm = LLM(
            tiny_llava_dir,
            device="cpu",
            dtype="float32",
            block_size=8,
            kv_cache_size_gb=0.01,
            kv_cache_memory_fraction=fraction,
            max_num_batched_tokens=tokens,
        )
        runner = llm.engine.runner
        assert llm.engine.kv.num_blocks == expected
        assert (
            sum(c.untyped_storage().nbytes() for c in runner.kv_caches)
            == expected * per_block
            <= 0.01 * GiB
        )


# ---- activation profile ------------------------------------------------------------------------


def test_profile_is_a_no_op_on_cpu(fp32_model):
    model, text = fp32_model
    runner = _runner(model, text, torch.float32)
    assert runner.profile_peak_activation_bytes(64) == 0
    assert runner.profile_peak_activation_bytes(512) == 0
    assert runner.kv_caches == []  # no scratch cache was allocated


@pytest.mark.gpu
def test_profile_on_cuda_is_positive_grows_with_tokens_and_frees_its_scratch_cache(tiny_llava_dir):
    model, text = _build(tiny_llava_dir, torch.float32, device="cuda")
    runner = _runner(model, text, torch.float32, device="cuda")
    runner.profile_peak_activation_bytes(
        32
    )  # first use allocates for good (cuBLAS workspace): not a step's peak
    small, large = (
        runner.profile_peak_activation_bytes(32),
        runner.profile_peak_activation_bytes(512),
    )
    assert 0 < small < large
    assert runner.kv_caches == [] and all(layer.kv_cache is None for layer in runner.attn_layers)


@pytest.mark.gpu
def test_profile_on_cuda_covers_an_eager_vision_encoder_and_the_encoder_cache(tmp_path_factory):
    """Qwen2-VL's vision tower runs eagerly (no encoder graphs): the profile with a blank picture as template
    runs the encoder on a step's worth of copies and adds the encoder cache's bound to the larger peak."""
    from mmserve.multimodal.processors import InputProcessor
    from mmserve.testing.qwen2_vl import make_qwen2_vl_checkpoint

    model_dir = str(
        make_qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), preset="tiny", seed=0)
    )
    model, text = _build(model_dir, torch.float32, device="cuda")
    runner = _runner(model, text, torch.float32, device="cuda", encoder_cache_size=4096)
    assert runner.encoder.graphs is None and not model.family.encoder_cuda_graphs
    template = InputProcessor(model_dir, load_hf_config(model_dir), type(model)).blank_image_item(
        (448, 448)
    )
    assert template is not None and template.length > 0
    text_only = runner.profile_peak_activation_bytes(512)
    with_vision = runner.profile_peak_activation_bytes(512, template)
    cache_bound = 4096 * text.hidden_size * 4
    assert with_vision >= text_only + cache_bound
    assert runner.kv_caches == [] and all(layer.kv_cache is None for layer in runner.attn_layers)
