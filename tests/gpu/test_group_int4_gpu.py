"""Group-wise int4 linears on a GPU: the Triton GEMV / GEMM against the dequantized fp32 formula at LLaVA-7B shapes
(M 1, 8, 64, 512; groups of 128; act-order g_idx), every GEMV config and the one-row choice, odd shapes (groups of
32 and 64, a last half block of 16 columns), CUDA-graph replays equal to eager calls, and a tiny model quantized at
load (int4_g128, w8a8) decoding through CUDA graphs as it does eagerly. W8A8's kernels: test_w8a8_gpu.py."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.group_int4 import pack_nibbles_k, quantize_groups
from mmserve.layers.group_int4_linear import dequantize_packed, group_int4_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def _weights(n: int, k: int, act_order: bool, seed: int):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q, s, z = quantize_groups(torch.randn(n, k, device=CUDA, generator=g) * 0.02, 128)
    g_idx = (torch.randperm(k, device=CUDA, generator=g) % (k // 128)).int() if act_order else None
    return pack_nibbles_k(q), s.half(), z, g_idx


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("n,k", [(12288, 4096), (4096, 11008)])
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_group_int4_linear_matches_the_formula(m, n, k, act_order, dtype):
    from mmserve.kernels.group_int4_gemm import group_int4_gemm
    from mmserve.kernels.group_int4_gemv import group_int4_gemv

    w, s, z, g_idx = _weights(n, k, act_order, m + n)
    x = torch.randn(m, k, device=CUDA, dtype=dtype)
    bias = torch.randn(n, device=CUDA, dtype=dtype)
    want = x.float() @ dequantize_packed(w, s, z, 128, g_idx, torch.float32).t() + bias.float()
    alone = (
        group_int4_gemv(x[0], w, s, z, 128, g_idx, bias)[None]
        if m == 1
        else group_int4_gemm(x, w, s, z, 128, g_idx, bias)
    )
    for got in (group_int4_linear(x, w, s, z, 128, g_idx, bias), alone):
        assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()


@pytest.mark.parametrize("m", [1, 8])
def test_group_int4_decode_replays_in_a_cuda_graph(m):
    w, s, z, g_idx = _weights(4096, 4096, True, 0)
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.float16)
    group_int4_linear(x, w, s, z, 128, g_idx)  # autotune before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = group_int4_linear(x, w, s, z, 128, g_idx)
    x.copy_(torch.randn(m, 4096, device=CUDA, dtype=torch.float16))
    graph.replay()
    torch.testing.assert_close(y, group_int4_linear(x, w, s, z, 128, g_idx), atol=0, rtol=0)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 11008)])
def test_every_gemv_config_matches_the_formula(n, k, act_order):
    """Each autotuner candidate (tile shapes, activations shared by a thread's rows or read per row), not only the
    one the autotuner keeps, and each of the GEMM's at one row (the other one-row candidate)."""
    from mmserve.kernels.group_int4_gemm import gemm_configs, group_int4_gemm
    from mmserve.kernels.group_int4_gemv import GEMV_CONFIGS, group_int4_gemv

    w, s, z, g_idx = _weights(n, k, act_order, 7)
    x = torch.randn(k, device=CUDA, dtype=torch.float16)
    want = x.float() @ dequantize_packed(w, s, z, 128, g_idx, torch.float32).t()
    for config in GEMV_CONFIGS:
        _close(group_int4_gemv(x, w, s, z, 128, g_idx, config=config), want)
    for config in gemm_configs(1):
        _close(group_int4_gemm(x[None], w, s, z, 128, g_idx, config=config)[0], want)


@pytest.mark.parametrize(
    "k,group,act_order", [(4096, 64, False), (4096, 32, False), (4104, 8, True), (1032, 24, True)]
)
@pytest.mark.parametrize("m", [1, 5, 100])
def test_group_int4_odd_groups_and_half_blocks(m, k, group, act_order):
    """Groups of 32 / 64 (several per tile), groups not a multiple of 16 and K = 16 b + 8 (a padded half block:
    the layer looks each column's group up, g_idx)."""
    g = torch.Generator(device=CUDA).manual_seed(k + m)
    q, s, z = quantize_groups(torch.randn(512, k, device=CUDA, generator=g) * 0.02, group)
    g_idx = (
        (torch.randperm(k, device=CUDA, generator=g) % (k // group)).int() if act_order else None
    )
    w, s = pack_nibbles_k(q), s.half()
    x = torch.randn(m, k, device=CUDA, dtype=torch.bfloat16)
    bias = torch.randn(512, device=CUDA, dtype=torch.bfloat16)
    want = x.float() @ dequantize_packed(w, s, z, group, g_idx, torch.float32).t() + bias.float()
    _close(group_int4_linear(x, w, s, z, group, g_idx, bias), want)


@pytest.mark.parametrize("quantization", ["int4_g128", "w8a8"])
def test_load_time_quantization_serves_with_cuda_graphs(tmp_path, quantization):
    """A tiny LLaVA (widths 128 / 256) with its decoder quantized at load, decoding through the CUDA graphs, gives
    the greedy tokens of its eager run."""
    from mmserve import LLM, SamplingParams
    from mmserve.testing.llava import make_llava_checkpoint

    src = make_llava_checkpoint(tmp_path / "src", seed=3, text_hidden=128, text_intermediate=256)
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0)
    prompts = [{"prompt": "tell me about it number 3"}, {"prompt": "one two"}]
    graphs = LLM(str(src), device="cuda", dtype="float16", quantization=quantization)
    eager = LLM(
        str(src), device="cuda", dtype="float16", quantization=quantization, enforce_eager=True
    )
    a = graphs.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


@pytest.mark.parametrize(
    "k,group,act_order", [(4096, 128, False), (4096, 32, False), (4104, 8, True), (1032, 24, True)]
)
def test_dequantization_kernel_equals_the_reference(k, group, act_order):
    """kernels/group_int4_dequant.py (prompts' cuBLAS candidate) gives the reference's weight bit for bit."""
    from mmserve.kernels.group_int4_dequant import group_int4_dequant

    g = torch.Generator(device=CUDA).manual_seed(k)
    q, s, z = quantize_groups(torch.randn(384, k, device=CUDA, generator=g) * 0.02, group)
    g_idx = (
        (torch.randperm(k, device=CUDA, generator=g) % (k // group)).int() if act_order else None
    )
    w, s = pack_nibbles_k(q), s.half()
    for dtype in (torch.float16, torch.bfloat16):
        want = dequantize_packed(w, s, z, group, g_idx, dtype)
        assert torch.equal(group_int4_dequant(w, s, z, group, g_idx, k, dtype), want)


@pytest.mark.parametrize("m", [24, 32, 64])
def test_every_gemm_config_of_a_decode_batch_matches_the_formula(m):
    """The 17-64-row buckets' own tiles and the 16-row tiles they may take (row tiles side by side), and K split."""
    from mmserve.kernels.group_int4_gemm import gemm_configs, group_int4_gemm

    g = torch.Generator(device=CUDA).manual_seed(m)
    q, s, z = quantize_groups(torch.randn(4096, 4096, device=CUDA, generator=g) * 0.02, 128)
    w, s = pack_nibbles_k(q), s.half()
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.float16)
    want = x.float() @ dequantize_packed(w, s, z, 128, None, torch.float32).t()
    configs = gemm_configs(m)
    assert any(c.kwargs["BLOCK_M"] == 16 for c in configs)
    for config in configs:
        _close(group_int4_gemm(x, w, s, z, 128, config=config), want)
    bias = torch.randn(4096, device=CUDA, dtype=torch.float16)
    for split in (2, 4):  # K in shares, summed after, the bias once
        _close(group_int4_gemm(x, w, s, z, 128, bias=bias, split_k=split), want + bias.float())
