"""Group-wise int4 and W8A8 linears on a GPU: the Triton GEMV / GEMM against the dequantized fp32 formula at
LLaVA-7B shapes (M 1, 8, 64, 512; groups of 128; act-order g_idx), W8A8's int8 GEMM (torch._int_mm, padded below
17 rows) against exact integer math, and CUDA-graph replays equal to eager calls."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.group_int4 import pack_nibbles_k, quantize_groups
from mmserve.layers.group_int4_linear import dequantize_packed, group_int4_linear
from mmserve.layers.w8a8_linear import quantize_rows_int8, w8a8_linear
from mmserve.layers.weight_only import quantize_weight_int8

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
    from mmserve.kernels.group_int4_gemm import group_int4_gemm, group_int4_gemv

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


@pytest.mark.parametrize("m", [1, 8, 17, 300])
def test_w8a8_int8_gemm_is_exact_integer_math(m):
    wq, ws = quantize_weight_int8(torch.randn(4096, 4096, device=CUDA) * 0.02)
    x = torch.randn(m, 4096, device=CUDA, dtype=torch.bfloat16)
    xq, xs = quantize_rows_int8(x)
    want = (xq.double() @ wq.double().t()) * xs.double()[:, None] * ws.double()[None, :]
    got = w8a8_linear(x, wq, ws)
    assert (got.double() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = w8a8_linear(x, wq, ws)
    graph.replay()
    torch.testing.assert_close(y, got, atol=0, rtol=0)


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
