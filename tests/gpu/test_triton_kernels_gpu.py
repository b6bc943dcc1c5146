"""Triton kernels vs the torch oracle at LLaVA-7B shapes (32 heads, head_dim 128, block 16, fp16) on a GPU.

Needs only torch, triton and pytest: `PYTHONPATH=. python3 -m pytest -q tests/gpu/test_triton_kernels_gpu.py`.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.attention_checks import make_batch, run_attention
from tests.kernels.check_registry import TOLERANCE, assert_close
from tests.kernels.triton_checks import rms_norm_reference, rotary_reference, silu_and_mul_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
HEADS, HEAD_DIM, BLOCK = 32, 128, 16


def _contexts(n: int, seed: int, longest: int = 4096) -> list[int]:
    rng = random.Random(seed)
    return [longest] + [rng.randint(1, longest) for _ in range(n - 1)]


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_decode_fp16_matches_torch_up_to_4k_context(batch: int) -> None:
    run_attention(
        [1] * batch,
        _contexts(batch, batch),
        HEADS,
        HEADS,
        HEAD_DIM,
        BLOCK,
        torch.float16,
        CUDA,
        num_pad_rows=3,
        tol=5e-3,
    )


@pytest.mark.parametrize("num_splits", [1, 5, 16])
def test_decode_split_counts_agree(num_splits: int) -> None:
    run_attention(
        [1] * 4,
        _contexts(4, 7),
        HEADS,
        HEADS,
        HEAD_DIM,
        BLOCK,
        torch.float16,
        CUDA,
        num_pad_rows=1,
        num_splits=num_splits,
        path="decode",
        tol=5e-3,
    )


def test_decode_gqa_bf16_and_fp32() -> None:
    run_attention(
        [1] * 16, _contexts(16, 3), HEADS, 8, HEAD_DIM, BLOCK, torch.bfloat16, CUDA, num_pad_rows=2
    )
    run_attention(
        [1] * 4, _contexts(4, 4), HEADS, 8, HEAD_DIM, BLOCK, torch.float32, CUDA
    )  # ieee, no TF32


def test_prefill_with_cached_prefix_and_mixed_decodes_one_launch() -> None:
    q_lens, ctx = [1024, 300, 1, 1, 77], [3072, 300, 4096, 55, 77]
    run_attention(q_lens, ctx, HEADS, HEADS, HEAD_DIM, BLOCK, torch.float16, CUDA, tol=5e-3)
    run_attention(q_lens, ctx, HEADS, 8, HEAD_DIM, BLOCK, torch.bfloat16, CUDA, num_pad_rows=4)
    run_attention(
        [200, 1], [900, 33], 28, 4, 80, BLOCK, torch.float16, CUDA, tol=5e-3
    )  # group 7, head_dim 80


@pytest.mark.parametrize("batch", [1, 64])
def test_fp8_cache_decode_and_prefill_match_torch(batch: int) -> None:
    """e4m3 cache with per-layer scales: the write is bit-exact with the torch backend's, attention close."""
    fp8 = torch.float8_e4m3fn
    run_attention(
        [1] * batch,
        _contexts(batch, 11),
        HEADS,
        HEADS,
        HEAD_DIM,
        BLOCK,
        torch.float16,
        CUDA,
        num_pad_rows=3,
        cache_dtype=fp8,
        kv_scales=(0.02, 0.05),
        tol=5e-3,
    )
    run_attention(
        [700, 1, 1],
        [1300, 4000, 9],
        HEADS,
        8,
        HEAD_DIM,
        BLOCK,
        torch.bfloat16,
        CUDA,
        cache_dtype=fp8,
        kv_scales=(1.0, 1.0),
    )


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_cuda_graph_replays_with_new_lengths_and_tables(batch: int) -> None:
    from mmserve.attention import torch_backend, triton_backend

    q, _, _, cache, meta = make_batch(
        [1] * batch, [4096] * batch, HEADS, HEADS, HEAD_DIM, BLOCK, torch.float16, CUDA
    )
    scale = HEAD_DIM**-0.5
    triton_backend.paged_attention(q, cache, meta, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_backend.paged_attention(q, cache, meta, scale)

    for seed in range(3):
        new = _contexts(batch, 100 + seed)
        if batch > 1:
            new[-1] = 0  # a padding row in the replayed batch
        meta.seq_lens.copy_(torch.tensor(new, dtype=torch.int32))
        meta.block_tables.copy_(meta.block_tables.flip(0))  # rows swap their blocks
        q.copy_(torch.randn_like(q))
        graph.replay()
        real = [i for i, n in enumerate(new) if n > 0]
        for i in real:
            sub = meta.__class__(
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=CUDA),
                seq_lens=meta.seq_lens[i : i + 1],
                block_tables=meta.block_tables[i : i + 1],
                slot_mapping=meta.slot_mapping[:0],
                query_start_loc_cpu=[0, 1],
                seq_lens_cpu=[new[i]],
                max_query_len=1,
                max_seq_len=new[i],
                block_size=BLOCK,
            )
            assert_close(
                out[i : i + 1],
                torch_backend.paged_attention(q[i : i + 1], cache, sub, scale),
                "replay",
                5e-3,
            )
        for i in set(range(batch)) - set(real):
            assert torch.equal(out[i], torch.zeros_like(out[i]))


def test_fused_ops_at_llama_7b_shapes() -> None:
    """RMSNorm (+ residual), rotary and SiLU-and-mul kernels at LLaVA-7B decoder shapes (300 tokens, hidden 4096,
    32 heads of 128, intermediate 11008, fp16) against explicit fp32 torch formulas: on CUDA the RMSNorm,
    RotaryEmbedding and SiluAndMul layers call these very kernels, so they cannot serve as the reference."""
    from mmserve.kernels.fused_ops import apply_rotary_, rms_norm, silu_and_mul
    from mmserve.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    eps, fp16 = 1e-6, torch.float16
    tol = TOLERANCE[fp16]
    weight = torch.randn(4096, device=CUDA).to(fp16)
    x, res = torch.randn(2, 300, 4096, device=CUDA, dtype=fp16).unbind(0)
    assert_close(rms_norm(x, weight, eps), rms_norm_reference(x, weight, eps), "rms_norm", tol)
    got, got_res = rms_norm(x, weight, eps, res)
    summed = x + res  # the residual stream, rounded to fp16 as the kernel stores it
    assert torch.equal(got_res, summed)
    assert_close(got, rms_norm_reference(summed, weight, eps), "rms_norm+residual", tol)

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 128, 2).float() / 128))
    rope = RotaryEmbedding(inv_freq, 4096).to(CUDA)
    positions = torch.randint(0, 4096, (300,), device=CUDA)
    qkv = torch.randn(300, 3 * 4096, device=CUDA, dtype=fp16)
    q, k = qkv[:, :4096].view(300, 32, 128), qkv[:, 4096:8192].view(300, 32, 128)
    want_q, want_k = (
        rotary_reference(positions, q, inv_freq),
        rotary_reference(positions, k, inv_freq),
    )
    v_before = qkv[:, 8192:].clone()
    apply_rotary_(positions, q, k, rope.cos, rope.sin)
    # the tables (built on the CPU) and the reference (on the GPU) take cos / sin of the same fp32 products
    # position * inv_freq; the two libraries differ by an ulp or two, far inside the fp16 tolerance
    assert_close(q, want_q, "rotary q", 5e-3)
    assert_close(k, want_k, "rotary k", 5e-3)
    assert torch.equal(qkv[:, 8192:], v_before), "rotary wrote outside q and k"

    gate_up = torch.randn(300, 2 * 11008, device=CUDA, dtype=fp16)
    assert_close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), "silu_and_mul", tol)
