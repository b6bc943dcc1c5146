"""Split-K decode attention over the paged KV cache, host side: `paged_decode_attention` launches the Triton
kernels of kernels/paged_decode_kernels.py with the kernel and tile `decode_tile` picks and the split-K
partition count `default_num_splits` picks, both from host shapes only.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton

from mmserve.kernels.fp8_format import cache_scales
from mmserve.kernels.paged_attention import _check_last_dim_contiguous, _precision
from mmserve.kernels.paged_decode_kernels import (
    _decode_kernel,
    _decode_reduce_kernel,
    _decode_rows_kernel,
)
from mmserve.kernels.pdl import pdl_options

_MIN_TOKENS_PER_SPLIT = (
    256  # a split-K partition shorter than this costs more to merge than it saves
)
_MAX_SPLITS = 32
FP8_WIDE_BATCH = (
    16  # from this many sequences an fp8 cache of grouped heads takes the register-capped tile
)
ROWS_MIN_BATCH = 8  # from this many sequences ungrouped heads take the CUDA-core kernel


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    distance_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its whole cached context.

    Args:
        q: [B, H, D], row i belongs to sequence i.
        kv_cache: [2, num_blocks, block_size, KVH, D].
        block_tables: [B, max_blocks] int32; its width bounds every context (and picks the split count).
        seq_lens: [B] int32 on device; 0 marks a padding row (its output is zero).
        scale: softmax scale.
        num_splits: split-K partitions per sequence; None picks one from host shapes only.
        k_scale, v_scale: an FP8 cache's scales (1.0 for caches in the model's dtype).
        out: where to write the result ([B, H, D], q's dtype, last dim contiguous); None allocates it.
        distance_bias: [H, N] fp32, last dim contiguous: added to the score of a key d positions before the query
            (T5's relative-position bias; N > every context; ungrouped heads only, through the CUDA-core kernel).
    Returns:
        out [B, H, D] in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    _check_last_dim_contiguous(q, kv_cache, out)
    k_scale, v_scale = cache_scales(kv_cache.dtype, k_scale, v_scale)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(
            num_seqs, num_kv_heads, block_tables.shape[1] * block_size, q.device
        )
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device
        )
    else:
        part_out = part_lse = out  # unused
    kc, vc = kv_cache[0], kv_cache[1]
    tile = decode_tile(d_pad, kv_cache.element_size(), num_seqs, group)
    if distance_bias is not None:
        if group != 1 or (distance_bias.stride(1) != 1 and distance_bias.shape[1] > 1):
            raise ValueError("distance_bias needs ungrouped heads and a contiguous last dim")
        tile = decode_tile(d_pad, kv_cache.element_size(), max(num_seqs, ROWS_MIN_BATCH), group)
        if not tile.rows:
            raise ValueError(f"distance_bias: head_dim {head_dim} is past the CUDA-core kernel's")
    args = (
        q,
        kc,
        vc,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * k_scale * math.log2(math.e),
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        block_tables.stride(0),
    )
    launch = dict(
        BLOCK_SIZE=block_size,
        BLOCK_N=tile.keys,
        SPLIT=split,
        num_warps=tile.warps,
        num_stages=tile.stages,
        **({"maxnreg": tile.maxnreg} if tile.maxnreg else {}),
        **pdl_options(q.device),
    )
    if tile.rows:
        bias = (distance_bias, distance_bias.stride(0)) if distance_bias is not None else (out, 0)
        _decode_rows_kernel[(num_heads, num_seqs, num_splits)](
            *args[:8],
            bias[0],
            *args[8:],
            bias[1],
            HEAD_DIM=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            HAS_BIAS=distance_bias is not None,
            **launch,
        )
    else:
        _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            *args,
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            PREC=_precision(q.dtype),
            **launch,
        )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=triton.next_power_of_2(head_dim),
            S_PAD=max(
                _MAX_SPLITS, triton.next_power_of_2(num_splits)
            ),  # one variant for every split count
            num_warps=4,
            **pdl_options(q.device),
        )
    return out


class DecodeTile(NamedTuple):
    """The decode kernel and its tile: keys per loop iteration, pipeline stages, warps, a cap on registers per
    thread (None: the compiler's choice), and whether it is the CUDA-core kernel (`_decode_rows_kernel`)."""

    keys: int
    stages: int
    warps: int
    maxnreg: int | None = None
    rows: bool = False


def decode_tile(d_pad: int, cache_bytes: int, num_seqs: int, group: int) -> DecodeTile:
    """The decode kernel and tile for a head size (padded), a cache element size, a batch size and the number
    of query heads per KV head.

    On an H100 (tests/kernels/bench_paged_decode.py, 32 heads x 128, 780 cached tokens; docs/benchmarks.md):
    ungrouped heads (LLaVA-7B) read fastest with the CUDA-core kernel in 32-key tiles from batch 8: fp8 caches
    capped at 96 registers (29 vs 34 us at 8, 294 vs 341 us at 128; at batch 1 it ties at 780 tokens and loses
    at 2048, 14.0 vs 11.7 us), fp16 caches at 128 (44 vs 46 us at 8, 71 vs 80 at 16, a tie at 128; without
    the cap 5-30 % slower). Below batch 8 both take the tensor-core kernel in 128-key tiles (fp16: 10.0 us
    at batch 1 vs 11.4 for 64 keys). For grouped heads the tensor-core kernel serves the whole group per tile; there
    the fp8 loop is bound by the instructions that transpose one-byte values into tensor-core operands, and the
    compiler gives it ~250 registers (two programs per SM): capped at 128 registers, 64-key tiles fit four and read
    7-8 % faster at batch 32-128 (MHA numbers, 337 vs 363 us at 128); at batch 1 (split-K, few programs) 128-key
    tiles stay faster. Slower, measured: 256 keys, 8 warps, 3-6 stages, sub-tiles, other register caps, scores alone
    on CUDA cores, fp8 to fp16 by integer bit moves, and a cache with values stored token-contiguous (3 % faster for
    fp8, 6 % slower for fp16).
    """
    if d_pad > 128:
        return DecodeTile(32, 2, 4)
    if group == 1 and num_seqs >= ROWS_MIN_BATCH:
        return DecodeTile(32, 2, 4, maxnreg=96 if cache_bytes == 1 else 128, rows=True)
    if cache_bytes == 1 and num_seqs >= FP8_WIDE_BATCH:
        return DecodeTile(64, 2, 4, maxnreg=128)
    return DecodeTile(128, 2, 4)


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device
) -> int:
    """Split-K partitions for decode, from host ints only (so a captured CUDA graph stays valid).

    Enough programs to fill the GPU about twice (four times when the (sequence, KV head) pairs fill under a
    quarter of the SMs: batch 1 is bound by each program's sequential tiles, not bandwidth; on an H100 7.8
    instead of 8.8 us at 600 tokens), but no partition shorter than _MIN_TOKENS_PER_SPLIT tokens of the
    largest possible context (max_context = block-table width x block size)."""
    programs = num_seqs * num_kv_heads
    sms = _num_sms(device)
    wanted = triton.cdiv((4 if 4 * programs <= sms else 2) * sms, programs)
    by_length = triton.cdiv(max_context, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


@functools.cache
def _num_sms_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the Triton CPU interpreter: a few splits so tests exercise split-K
    return _num_sms_of(device.index if device.index is not None else torch.cuda.current_device())
