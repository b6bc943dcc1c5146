"""kernels/fp8_gemv.py's swapped-operand FP8 GEMM on a GPU with FP8 tensor cores, at llava-1.5-7b decode shapes:
every tile of SWAP_CONFIGS and the split-K form within the small-M GEMM's bound of the torch reference, and
fp8_matmul's timed choice among the few-row candidates replaying in a CUDA graph to the eager call's bits."""

from __future__ import annotations

import pytest
import torch

from mmserve.layers.fp8_linear import fp8_linear_reference, fp8_supported, quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
SHAPES = [
    (12288, 4096),
    (4096, 4096),
    (22016, 4096),
    (4096, 11008),
]  # qkv, o, gate_up, down (N x K)


@pytest.fixture(autouse=True)
def _needs_fp8() -> None:
    if not fp8_supported(CUDA):
        pytest.skip("FP8 tensor cores need compute capability >= 8.9")


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 8, 32])
def test_swap_ab_tiles_and_split_k_match_reference(m: int, n: int, k: int) -> None:
    from mmserve.kernels.fp8_gemm import quant_rows
    from mmserve.kernels.fp8_gemv import SWAP_CONFIGS, fp8_gemm_swap_ab

    g = torch.Generator(device=CUDA).manual_seed(m + n + k)
    w, ws = quantize_weight(torch.randn(n, k, device=CUDA, generator=g) * 0.02)
    x = torch.randn(m, k, device=CUDA, generator=g, dtype=torch.float16)
    bias = torch.randn(n, device=CUDA, generator=g, dtype=torch.float16)
    xq, xs = quant_rows(x)
    want = fp8_linear_reference(x, w, ws, None, bias).float()
    scale = want.abs().max().item()
    runs = {f"split {s}": dict(split_k=s) for s in (1, 2, 4)}
    runs.update({str(c): dict(config=c) for c in SWAP_CONFIGS})
    for name, kwargs in runs.items():
        got = fp8_gemm_swap_ab(xq, xs, w, ws, bias, torch.float16, **kwargs).float()
        assert (got - want).abs().max().item() <= 4e-3 * scale, name


@pytest.mark.parametrize("m", [1, 8, 32])
def test_few_row_choice_replays_in_a_cuda_graph(m: int) -> None:
    from mmserve.kernels.fp8_gemm import fp8_matmul

    n, k = SHAPES[1]  # o_proj: the one with a split-K candidate at every M
    w, ws = quantize_weight(torch.randn(n, k, device=CUDA) * 0.02)
    x = torch.randn(m, k, device=CUDA, dtype=torch.float16)
    fp8_matmul(x, w, ws, None, None)  # times the candidates before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_matmul(x, w, ws, None, None)
    x.copy_(torch.randn(m, k, device=CUDA, dtype=torch.float16))
    graph.replay()
    torch.testing.assert_close(y, fp8_matmul(x, w, ws, None, None), atol=0, rtol=0)
