"""Checks of the paged-attention kernels (cache writes, decode, prefill, mixed batches, rotary + cache
write) against the torch backend, and the batch builder they share with the GPU tests and benches.
"""

from __future__ import annotations

import torch

from tests.kernels.check_registry import INTERPRET, assert_close, check, interpreter_fp8_rounding

# --------------------------------------------------------------------------------------------- batch builder


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_pad_rows: int = 0,
    extra_blocks: int = 2,
    seed: int = 0,
    cache_dtype: torch.dtype | None = None,
    head_major: bool = True,
):
    """Random queries, new K/V and a cache whose prefix blocks are scattered over a shuffled pool (stored in
    the engine's memory order, attention/kv_layout.py, unless head_major is False).

    Padding rows (CUDA-graph style) have one query token each, seq_len 0 and slot -1.
    Returns (q [T, H, D], k [T, KVH, D], v [T, KVH, D], kv_cache, meta).
    """
    from mmserve.attention.kv_layout import new_kv_cache
    from mmserve.attention.metadata import AttentionMetadata

    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    width = max(blocks_per_seq + [1]) + extra_blocks  # a fixed, wider-than-needed table
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    kv_cache = new_kv_cache(
        num_blocks, block_size, num_kv_heads, head_dim, cache_dtype or dtype, device, head_major
    )
    kv_cache.copy_(torch.randn(kv_cache.shape, generator=gen, device=device))
    tables = torch.zeros(len(q_lens) + num_pad_rows, width, dtype=torch.int32)
    slots, used = [], 0
    for i, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
        tables[i, : blocks_per_seq[i]] = perm[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        slots += [
            int(tables[i, p // block_size]) * block_size + p % block_size
            for p in range(ctx - q_len, ctx)
        ]
    q_lens = q_lens + [1] * num_pad_rows
    ctx_lens = ctx_lens + [0] * num_pad_rows
    slots += [-1] * num_pad_rows
    total = sum(q_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(total, num_heads, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=ctx_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
        block_size=block_size,
    )
    return q, k, v, kv_cache, meta


def real_rows(meta, num_real: int) -> tuple[list[int], object]:
    """The meta restricted to the first num_real sequences (the oracle cannot attend over 0 keys)."""
    from dataclasses import replace

    end = meta.query_start_loc_cpu[num_real]
    sub = replace(
        meta,
        query_start_loc=meta.query_start_loc[: num_real + 1],
        seq_lens=meta.seq_lens[:num_real],
        block_tables=meta.block_tables[:num_real],
        slot_mapping=meta.slot_mapping[:end],
        query_start_loc_cpu=meta.query_start_loc_cpu[: num_real + 1],
        seq_lens_cpu=meta.seq_lens_cpu[:num_real],
        max_query_len=max(
            b - a
            for a, b in zip(
                meta.query_start_loc_cpu[:num_real], meta.query_start_loc_cpu[1 : num_real + 1]
            )
        ),
        max_seq_len=max(meta.seq_lens_cpu[:num_real]),
    )
    return end, sub


def assert_cache_equal(cache: torch.Tensor, want: torch.Tensor, src_dtype: torch.dtype) -> None:
    if (
        cache.dtype == torch.float8_e4m3fn
    ):  # bit-exact: same scaling, saturation and rounding as the oracle
        differs = cache.view(torch.uint8) != want.view(torch.uint8)
        if INTERPRET:
            differs &= ~interpreter_fp8_rounding(cache, want)
        assert not differs.any(), (
            f"write_kv: {int(differs.sum())} fp8 cache entries differ from the torch backend"
        )
    elif INTERPRET and cache.dtype == torch.bfloat16 and src_dtype == torch.float32:
        # the interpreter truncates fp32 -> bf16 where GPUs round to nearest even: allow one bf16 ulp
        assert ((cache.float() - want.float()).abs() <= want.float().abs() * 2**-7).all(), (
            "write_kv: cache"
        )
    else:
        assert torch.equal(cache, want), "write_kv: cache differs from the torch backend"


def run_attention(
    q_lens,
    ctx_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype,
    device,
    num_pad_rows=0,
    num_splits=None,
    path="backend",
    seed=0,
    cache_dtype=None,
    tol=None,
    kv_scales=(1.0, 1.0),
    num_decodes=0,
    head_major=True,
) -> None:
    """Write K/V and attend with both backends; compare caches and the real rows' outputs."""
    from dataclasses import replace

    from mmserve.attention import torch_backend, triton_backend
    from mmserve.kernels import paged_attention as kernels
    from mmserve.kernels import paged_decode

    q, k, v, cache, meta = make_batch(
        q_lens,
        ctx_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        device,
        num_pad_rows,
        seed=seed,
        cache_dtype=cache_dtype,
        head_major=head_major,
    )
    meta = replace(meta, num_decodes=num_decodes)
    want_cache = cache.clone()
    end, sub = real_rows(meta, len(q_lens))
    ks, vs = kv_scales
    torch_backend.write_kv(k[:end], v[:end], want_cache, sub.slot_mapping, ks, vs)
    triton_backend.write_kv(k, v, cache, meta.slot_mapping, ks, vs)
    assert_cache_equal(cache, want_cache, k.dtype)

    scale = head_dim**-0.5
    if path == "decode":
        out = paged_decode.paged_decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, scale, num_splits, k_scale=ks, v_scale=vs
        )
    elif path == "prefill":
        out = kernels.paged_prefill_attention(
            q,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            k_scale=ks,
            v_scale=vs,
        )
    else:
        out = triton_backend.paged_attention(q, cache, meta, scale, ks, vs)
    want = torch_backend.paged_attention(q[:end], cache, sub, scale, ks, vs)
    assert_close(out[:end], want, f"{path} attention", tol)
    if num_pad_rows:
        assert torch.equal(out[end:], torch.zeros_like(out[end:])), "padding rows must be zero"


# --------------------------------------------------------------------------------------------- cache write


@check
def check_reshape_and_cache_skips_padding_slots(device):
    from mmserve.attention import torch_backend
    from mmserve.kernels.paged_attention import reshape_and_cache

    for dtype, cache_dtype in [
        (torch.float32, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
    ]:
        _, k, v, cache, meta = make_batch(
            [3, 2], [7, 2], 6, 3, 20, 4, dtype, device, num_pad_rows=2
        )
        cache = cache.to(cache_dtype)
        want = cache.clone()
        real = meta.slot_mapping >= 0
        torch_backend.write_kv(k[real], v[real], want, meta.slot_mapping[real])
        # k/v as strided views of a fused qkv projection, like the Attention layer passes them
        qkv = torch.cat([k, v, k], dim=1)
        reshape_and_cache(qkv[:, :3], qkv[:, 3:6], cache, meta.slot_mapping)
        assert_cache_equal(cache, want, dtype)


@check
def check_reshape_and_cache_fp8_scales_and_saturates(device):
    from mmserve.attention import torch_backend
    from mmserve.kernels.paged_attention import reshape_and_cache

    fp8 = torch.float8_e4m3fn
    for dtype, scales in [
        (torch.float32, (1.0, 1.0)),
        (torch.float16, (0.0005, 2.5)),
        (torch.float32, (0.3, 0.01)),
    ]:
        _, k, v, cache, meta = make_batch(
            [3, 2], [7, 2], 6, 3, 20, 4, dtype, device, num_pad_rows=2, cache_dtype=fp8
        )
        want = cache.clone()
        real = meta.slot_mapping >= 0
        torch_backend.write_kv(k[real], v[real], want, meta.slot_mapping[real], *scales)
        reshape_and_cache(k, v, cache, meta.slot_mapping, *scales)
        assert_cache_equal(cache, want, dtype)
        slots = meta.slot_mapping[real]
        stored = want[0][slots // 4, slots % 4].float()
        assert torch.isfinite(stored).all(), "fp8 writes must saturate, not overflow to NaN"
        if scales[0] < 0.01:  # |k| / 0.0005 exceeds 448 for most entries
            assert (stored.abs() == 448).float().mean() > 0.5, (
                "expected saturated values at the e4m3 limit"
            )


# --------------------------------------------------------------------------------------------- decode


@check
def check_decode_gqa_split_k_over_many_blocks(device):
    run_attention(
        [1] * 4, [1, 37, 130, 301], 8, 2, 64, 8, torch.float32, device, num_splits=4, path="decode"
    )


@check
def check_decode_gqa_more_splits_than_tiles(device):
    run_attention(
        [1] * 3, [3, 64, 65], 4, 1, 32, 4, torch.float32, device, num_splits=7, path="decode"
    )


@check
def check_decode_mha_without_split_head_dim_20(device):
    run_attention(
        [1] * 3, [5, 66, 200], 4, 4, 20, 16, torch.float32, device, num_splits=1, path="decode"
    )


@check
def check_decode_and_prefill_head_dims_96_and_128(device):
    run_attention(
        [1] * 2, [33, 160], 4, 2, 96, 16, torch.float32, device, num_splits=2, path="decode"
    )
    run_attention([9, 1], [40, 17], 2, 1, 128, 16, torch.float32, device, path="prefill")


@check
def check_decode_padding_rows_are_zero_with_and_without_split(device):
    for splits in (1, 3):
        run_attention(
            [1] * 2,
            [20, 90],
            4,
            2,
            20,
            8,
            torch.float32,
            device,
            num_pad_rows=3,
            num_splits=splits,
            path="decode",
        )


@check
def check_decode_fp16_and_bf16_through_backend(device):
    run_attention([1] * 3, [17, 128, 250], 8, 2, 64, 16, torch.float16, device, num_pad_rows=1)
    run_attention([1] * 2, [40, 99], 6, 2, 20, 8, torch.float32, device, cache_dtype=torch.bfloat16)
    if not INTERPRET:  # the Triton interpreter's tl.dot reads bf16 operands as raw integers
        run_attention([1] * 2, [40, 99], 6, 2, 20, 8, torch.bfloat16, device)


@check
def check_decode_and_prefill_over_fp8_cache_with_scales(device):
    fp8 = torch.float8_e4m3fn
    run_attention(
        [1] * 3,
        [17, 128, 250],
        8,
        2,
        64,
        16,
        torch.float16,
        device,
        num_pad_rows=1,
        cache_dtype=fp8,
        kv_scales=(0.05, 0.02),
        num_splits=3,
        path="decode",
    )
    run_attention(
        [1] * 2,
        [40, 99],
        4,
        4,
        20,
        8,
        torch.float32,
        device,
        cache_dtype=fp8,
        num_splits=1,
        path="decode",
    )
    run_attention(
        [5, 9, 1],
        [21, 9, 40],
        8,
        2,
        64,
        4,
        torch.float16,
        device,
        cache_dtype=fp8,
        kv_scales=(0.03, 0.07),
        path="prefill",
    )
    # a batch wide enough for the fp8 cache's other tile (kernels.decode_tile)
    from mmserve.kernels.paged_decode import FP8_WIDE_BATCH

    run_attention(
        [1] * FP8_WIDE_BATCH,
        [9 + 23 * i for i in range(FP8_WIDE_BATCH)],
        4,
        2,
        64,
        16,
        torch.float16,
        device,
        cache_dtype=fp8,
        kv_scales=(0.05, 0.02),
        num_splits=2,
        path="decode",
    )


@check
def check_decode_cuda_core_kernel(device):
    # ungrouped heads from ROWS_MIN_BATCH sequences: the per-key-row softmax kernel over fp8 (with scales), fp16
    # and fp32 caches, with and without split-K, padding rows, a head size that is not a power of two
    from mmserve.kernels.paged_decode import ROWS_MIN_BATCH, decode_tile

    fp8 = torch.float8_e4m3fn
    assert decode_tile(64, 1, ROWS_MIN_BATCH, 1).rows and decode_tile(64, 2, ROWS_MIN_BATCH, 1).rows
    assert (
        not decode_tile(64, 1, ROWS_MIN_BATCH, 2).rows
        and not decode_tile(64, 1, ROWS_MIN_BATCH - 1, 1).rows
    )
    ctx = [1, 31, 32, 33, 95, 140, 17, 64][:ROWS_MIN_BATCH] + [50] * max(0, ROWS_MIN_BATCH - 8)
    for splits in (1, 3):
        run_attention(
            [1] * len(ctx),
            ctx,
            4,
            4,
            64,
            16,
            torch.float16,
            device,
            num_pad_rows=2,
            cache_dtype=fp8,
            kv_scales=(0.05, 0.02),
            num_splits=splits,
            path="decode",
        )
    run_attention(
        [1] * len(ctx),
        ctx,
        2,
        2,
        20,
        8,
        torch.float32,
        device,
        cache_dtype=fp8,
        num_splits=2,
        path="decode",
    )
    run_attention(
        [1] * len(ctx),
        ctx,
        4,
        4,
        64,
        16,
        torch.float16,
        device,
        num_pad_rows=1,
        num_splits=2,
        path="decode",
    )
    run_attention(
        [1] * len(ctx), ctx, 2, 2, 20, 8, torch.float32, device, num_splits=1, path="decode"
    )


@check
def check_decode_and_prefill_over_a_token_major_cache(device):
    # the kernels follow the cache's strides: the memory order as indexed works too
    run_attention(
        [1] * 3,
        [17, 128, 250],
        8,
        2,
        64,
        16,
        torch.float16,
        device,
        num_splits=3,
        path="decode",
        head_major=False,
    )
    run_attention(
        [5, 9, 1], [21, 9, 40], 8, 2, 64, 4, torch.float32, device, path="prefill", head_major=False
    )


# --------------------------------------------------------------------------------------------- prefill / mixed


@check
def check_prefill_with_cached_prefix_gqa(device):
    run_attention([5, 9, 1], [21, 9, 40], 8, 2, 64, 4, torch.float32, device, path="prefill")


@check
def check_prefill_without_prefix_mha_head_dim_20(device):
    run_attention([70, 3], [70, 3], 2, 2, 20, 8, torch.float32, device, path="prefill")


@check
def check_mixed_batch_prefill_chunks_and_decodes_one_launch(device):
    # group of 3 query heads per KV head (not a power of two); q_len > BLOCK_M // group for several programs
    run_attention(
        [30, 1, 12, 1], [95, 50, 12, 7], 6, 2, 20, 8, torch.float32, device, num_pad_rows=2
    )


@check
def check_mixed_batch_fp16(device):
    run_attention([17, 1, 1], [60, 33, 129], 8, 2, 64, 16, torch.float16, device)
    if not INTERPRET:
        run_attention([17, 1, 1], [60, 33, 129], 8, 2, 64, 16, torch.bfloat16, device)


@check
def check_mixed_batch_split_decodes_first(device):
    # the backend sends the leading one-query sequences to the decode kernel, the rest to the prefill kernel
    run_attention(
        [1, 1, 1, 30, 12],
        [50, 7, 129, 95, 12],
        6,
        2,
        20,
        8,
        torch.float32,
        device,
        num_pad_rows=2,
        num_decodes=3,
    )
    run_attention(
        [1, 1, 17],
        [300, 33, 60],
        8,
        2,
        64,
        16,
        torch.float16,
        device,
        cache_dtype=torch.float8_e4m3fn,
        kv_scales=(0.03, 0.07),
        num_decodes=2,
    )


@check
def check_rotary_and_cache_write_fused_match_unfused(device):
    from mmserve.kernels.fused_ops import apply_rotary_
    from mmserve.kernels.paged_attention import reshape_and_cache
    from mmserve.kernels.rotary_cache import rotary_and_cache
    from mmserve.layers.rotary import RotaryEmbedding

    fp8 = torch.float8_e4m3fn
    for dtype, cache_dtype, head_dim, scales in [
        (torch.float32, torch.float32, 20, (1.0, 1.0)),
        (torch.float16, torch.float16, 64, (1.0, 1.0)),
        (torch.float16, fp8, 64, (0.02, 0.05)),
    ]:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        rope = RotaryEmbedding(inv_freq, 64, scaling=0.9).to(device)
        # 2 real sequences and 2 padding rows (slot -1) of a CUDA-graph batch; GQA: 6 query heads, 3 KV heads
        _, _, _, cache, meta = make_batch(
            [3, 2],
            [7, 2],
            6,
            3,
            head_dim,
            4,
            dtype,
            device,
            num_pad_rows=2,
            cache_dtype=cache_dtype,
        )
        gen = torch.Generator().manual_seed(3)
        qkv = torch.randn(7, 12 * head_dim, generator=gen).to(device=device, dtype=dtype)
        positions = torch.randint(0, 64, (7,), generator=gen).to(device)

        def split(x):
            return (
                x[:, : 6 * head_dim].view(7, 6, head_dim),
                x[:, 6 * head_dim : 9 * head_dim].view(7, 3, head_dim),
                x[:, 9 * head_dim :].view(7, 3, head_dim),
            )

        want_cache, want_qkv, qkv_before = cache.clone(), qkv.clone(), qkv.clone()
        q, k, v = split(want_qkv)
        apply_rotary_(positions, q, k, rope.cos, rope.sin)
        reshape_and_cache(k, v, want_cache, meta.slot_mapping, *scales)
        q, k, v = split(qkv)
        k_before = k.clone()
        assert (
            rotary_and_cache(
                positions, q, k, v, cache, meta.slot_mapping, rope.cos, rope.sin, *scales
            )
            is q
        )
        assert torch.equal(q, split(want_qkv)[0]), f"rotated queries {dtype}"
        assert torch.equal(k, k_before), "the fused kernel leaves k as given"
        assert_cache_equal(cache, want_cache, dtype)
        # into another buffer (the piecewise graphs' persistent queries): same values, q and the cache as before
        q, k, v = split(qkv_before)
        q_before, out = q.clone(), torch.full((7, 6, head_dim), 7.0, dtype=dtype, device=device)
        assert (
            rotary_and_cache(
                positions, q, k, v, cache, meta.slot_mapping, rope.cos, rope.sin, *scales, q_out=out
            )
            is out
        )
        assert torch.equal(out, split(want_qkv)[0]) and torch.equal(q, q_before), (
            f"rotated into q_out {dtype}"
        )
        assert_cache_equal(cache, want_cache, dtype)
