"""Triton kernels for group-wise int4 weights (layers/group_quant_linear.py's layout): y [M, N] = x [M, K] @ W^T
(+ bias) with W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], q packed two to a byte along K (uint8 [N, K / 2] in
blocks of 16 columns: byte j of block b holds column 16b + j in its low nibble and 16b + 8 + j in its high one,
layers/group_int4.pack_nibbles_k), s fp16 [N, G], z uint8 [N, G], g(k) = k // GROUP or g_idx[k] (GPTQ act-order,
row-parallel shards that do not hold whole groups). This file: the GEMM and what both kernels share;
kernels/group_int4_gemv.py: the one-row GEMV.

Both kernels dequantize in registers with `dequant_pair`: a nibble u less its zero z is the exact fp32
(2^23 + u) - (2^23 + z), 2^23 + u being u OR-ed into the mantissa of 2^23 (no int-to-float instruction; the idea
of kernels/gemv.py `int4_as_float`). The high nibble is taken in place, as 16 u (one AND, no shift), and its 1/16
folded into the scale (exact: a power of two). Scaled into fp16 (the GEMM's operands, the dequantized copy), the
same is done with fp16's 1024 (`_fp16_pair`): no fp32-to-fp16 conversion per weight, 0-14 % less time per projection
at 16-64 rows on an H100 (docs/lab/2026-11-27-issue-35-h100-before-after.md). The block layout puts the low nibbles
of 8 bytes against 8 contiguous activations and the high nibbles against the next 8, so each half of x is read in
16-byte vectors.

`group_int4_gemm` computes [BLOCK_N, BLOCK_M] tiles of y^T = W x^T on the tensor cores (operands swapped as in
kernels/weight_only_gemm.py: the dequantized weight tile is the left operand, a few rows of x the narrow side); a
K tile inside one group loads one scale and zero per row. Up to SMALL_M rows (decode) it streams the weights with
narrow tiles; more rows (prompts) take 128-row tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmserve.kernels.fastest import bench_ms
from mmserve.kernels.m_tiles import SMALL_M, m_tile, prune_m_tiles
from mmserve.kernels.pdl import pdl_options, release_dependents, wait_for_previous

# a block's low nibbles are its first 8 columns, the high nibbles the next 8
HALF_BLOCK = tl.constexpr(8)

_GEMM_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bm in (16, 32, 64)
    for bn, bk, w, st in [
        (64, 128, 4, 4),
        (128, 128, 8, 3),
        (32, 128, 4, 4),
        (64, 64, 4, 4),
        (16, 128, 4, 3),
    ]
] + [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [
        (128, 64, 8, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 4),
        (256, 64, 8, 3),
        (128, 128, 4, 4),
    ]
]


def _prune(configs, named_args, **kwargs):
    """The configs of the call's bucket of M (kernels/m_tiles.py) and, for 17 to SMALL_M rows, the 16-row tiles too:
    their programs for one weight tile run side by side (M is the grid's first axis) and read it from L2 once read,
    where a 32- or 64-wide dot of the dequantized tile may compile to a slower path than two 16-wide ones."""
    bucket = prune_m_tiles(configs, named_args)
    if 16 < named_args["M"] <= SMALL_M:
        bucket += [c for c in configs if c.kwargs["BLOCK_M"] == 16]
    return bucket


def gemm_configs(m: int) -> list[triton.Config]:
    """The GEMM's autotuning candidates for M rows."""
    return _prune(_GEMM_CONFIGS, {"M": m})


def _per_group(group_size: int, has_g_idx: bool) -> bool:
    """Whether the kernels may load one scale and zero per row and group part of a tile (module docstring)."""
    return not has_g_idx and group_size >= 16 and group_size & (group_size - 1) == 0


@triton.jit
def low_columns(t):
    """The column (from the tile's start) of the low nibble of byte t of a tile; the high nibble's is 8 more."""
    return (t // HALF_BLOCK) * (2 * HALF_BLOCK) + t % HALF_BLOCK


@triton.jit
def _group(cols, c_mask, g_ptr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr):
    if HAS_G_IDX:
        return tl.load(g_ptr + cols, mask=c_mask, other=0)
    else:
        return cols // GROUP


@triton.jit
def _exact_pair(packed, z_lo, z_hi):
    """(q - z) of the low nibbles of `packed` and 16 (q - z) of the high ones, exact in fp32: a byte OR-ed into the
    mantissa of 2^23 is 2^23 + byte, then one AND (one immediate) keeps a nibble."""
    b = packed.to(tl.uint32) | 0x4B000000
    lo = (b & 0x4B00000F).to(tl.float32, bitcast=True) - (z_lo + 8388608.0)
    hi = (b & 0x4B0000F0).to(tl.float32, bitcast=True) - (z_hi * 16.0 + 8388608.0)
    return lo, hi


@triton.jit
def scaled_pair(packed, z_lo, z_hi, s_lo, s_hi, DTYPE: tl.constexpr):
    """(q - z) * s of the (low, high) nibbles of `packed` rounded once to DTYPE, given their zeros (fp32) and
    fp16 scales broadcastable to the tile."""
    if DTYPE == tl.float16:  # the scales' own dtype: no conversion per weight
        lo, hi = _fp16_pair(packed, z_lo, z_hi, s_lo, s_hi)
    else:
        lo, hi = _exact_pair(packed, z_lo, z_hi)
        s_lo, s_hi = s_lo.to(tl.float32), s_hi.to(tl.float32)
        lo, hi = (lo * s_lo).to(DTYPE), (hi * (s_hi * 0.0625)).to(DTYPE)
    return lo, hi


@triton.jit
def _fp16_pair(packed, z_lo, z_hi, s_lo, s_hi):
    """dequant_pair's scaled (low, high) nibbles made in fp16: 0x6400 is 1024.0, and a nibble u OR-ed into its
    mantissa is 1024 + u exactly; less 1024 + z (exact) it is the small integer u - z, and one fp16 multiply by the
    scale rounds the exact product once, as the fp32 path's product rounded to fp16 (the same bits)."""
    b = packed.to(tl.uint16)
    lo = ((b & 0xF) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = ((b >> 4) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
    lo = lo - (z_lo + 1024.0).to(tl.float16)
    hi = hi - (z_hi + 1024.0).to(tl.float16)
    return lo * s_lo, hi * s_hi


@triton.jit
def dequant_pair(
    packed,
    rows,
    mask,
    hi_mask,
    cols,
    g_ptr,
    s_ptr,
    z_ptr,
    GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    SCALED: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """(low, high) nibbles of the uint8 tile `packed` less their group's zero; the high ones times 16 (module
    docstring). SCALED: times the group's scale (the high ones' / 16), in DTYPE; else exact fp32, the caller scales.
    rows: the tile's rows times G (int64); cols: the low nibbles' absolute columns (the high ones' are 8 more),
    broadcastable to packed ([..., 1] where a row's part of the tile lies in one group); mask, hi_mask: rows and
    the low / high nibbles' columns in range (they differ in a last half block of 8 columns)."""
    g_lo = _group(cols, mask, g_ptr, GROUP, HAS_G_IDX)
    z_lo = tl.load(z_ptr + rows + g_lo, mask=mask, other=0).to(tl.float32)
    if HAS_G_IDX:  # a column's group is its own: the high nibbles' are looked up apart
        g_hi = _group(cols + HALF_BLOCK, hi_mask, g_ptr, GROUP, HAS_G_IDX)
        z_hi = tl.load(z_ptr + rows + g_hi, mask=hi_mask, other=0).to(tl.float32)
    else:  # GROUP is a multiple of 16 (layers/group_quant_linear.py): a block lies in one group
        g_hi, z_hi = g_lo, z_lo
    if SCALED:
        s_lo = tl.load(s_ptr + rows + g_lo, mask=mask, other=0.0)
        if HAS_G_IDX:
            s_hi = tl.load(s_ptr + rows + g_hi, mask=hi_mask, other=0.0)
        else:
            s_hi = s_lo
        lo, hi = scaled_pair(packed, z_lo, z_hi, s_lo, s_hi, DTYPE)
    else:
        lo, hi = _exact_pair(packed, z_lo, z_hi)
    return lo, hi


@triton.autotune(
    configs=_GEMM_CONFIGS,
    key=["M_TILE", "N", "K", "GROUP", "HAS_G_IDX", "SPLIT_K"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=bench_ms,
)
@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    G,
    stride_x,
    stride_w,
    stride_y,
    stride_split,
    M_TILE,
    GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    PER_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    M_MAJOR: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    # decode's few rows: a weight tile's row tiles side by side (it is read once); prompts: a row tile's weight
    # tiles side by side (its activations are read once)
    if M_MAJOR:
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    rb = tl.arange(0, BLOCK_K // 2)  # bytes of a K tile
    low = low_columns(rb)
    x_cols = x_ptr + rm[None, :].to(tl.int64) * stride_x + low[:, None]  # x^T, low-nibble columns
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w + rb[None, :]
    row_groups = rn.to(tl.int64) * G
    rows = row_groups[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y^T tile
    # split K: this program's share of the K tiles, its partial sums to its own slice of an fp32 workspace
    k_share = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = tl.program_id(2) * k_share
    for k in range(k_start, tl.minimum(K, k_start + k_share), BLOCK_K):
        c_lo, c_hi = (k + low) < K, (k + low + HALF_BLOCK) < K  # K is a multiple of 8
        x_lo = tl.load(x_cols + k, mask=c_lo[:, None] & m_mask[None, :], other=0.0)
        x_hi = tl.load(x_cols + k + HALF_BLOCK, mask=c_hi[:, None] & m_mask[None, :], other=0.0)
        mask = n_mask[:, None] & c_lo[None, :]
        packed = tl.load(w_rows + k // 2, mask=mask, other=0)
        if PER_GROUP and GROUP % BLOCK_K == 0:  # the tile in one group: a scale and a zero per row
            # loaded as vectors: each thread reads its own rows' once, not once per weight it holds
            z = tl.load(z_ptr + row_groups + k // GROUP, mask=n_mask, other=0).to(tl.float32)
            s = tl.load(s_ptr + row_groups + k // GROUP, mask=n_mask, other=0.0)
            lo, hi = scaled_pair(packed, z[:, None], z[:, None], s[:, None], s[:, None], x_lo.dtype)
        else:
            lo, hi = dequant_pair(
                packed,
                rows,
                mask,
                n_mask[:, None] & c_hi[None, :],
                (k + low)[None, :],
                g_ptr,
                s_ptr,
                z_ptr,
                GROUP,
                HAS_G_IDX,
                True,
                x_lo.dtype,
            )
        acc = tl.dot(lo, x_lo, acc)
        acc = tl.dot(hi, x_hi, acc)
    release_dependents(PDL)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    y_tile = y_ptr + tl.program_id(2).to(tl.int64) * stride_split
    tl.store(
        y_tile + rm[None, :].to(tl.int64) * stride_y + rn[:, None],
        acc.to(y_ptr.dtype.element_ty),
        mask=n_mask[:, None] & m_mask[None, :],
    )


def check_layout(
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    k: int,
) -> tuple[int, int, torch.Tensor, torch.Tensor, dict]:
    """(N, K, the g_idx pointer, the bias pointer, the kernels' flags) for K input features, after checking the
    layout (module docstring); an absent g_idx or bias passes a tensor the kernel does not read."""
    n = weight.shape[0]
    assert weight.stride(1) == 1 and scales.is_contiguous() and zeros.is_contiguous(), (
        "contiguous layout"
    )
    assert k % 8 == 0 and 2 * weight.shape[1] == -(-k // 16) * 16, (k, tuple(weight.shape))
    # without g_idx a block of 16 columns lies in one group, and K holds whole groups
    assert g_idx is not None or (group_size % 16 == 0 and k % group_size == 0), (k, group_size)
    g = g_idx if g_idx is not None else zeros  # an unread pointer
    flags = dict(
        GROUP=group_size,
        HAS_G_IDX=g_idx is not None,
        PER_GROUP=_per_group(group_size, g_idx is not None),
        HAS_BIAS=bias is not None,
    )
    return n, k, g, bias if bias is not None else scales, flags


def group_int4_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: triton.Config | None = None,
    split_k: int = 1,
) -> torch.Tensor:
    """y [M, N] (x's dtype) for x [M, K] (unit stride along K); the weights as for `group_int4_gemv`. `config`: one
    of gemm_configs(M) instead of the autotuner's choice. `split_k` > 1: K in that many shares, each program's
    partial sums in fp32, added in order after (deterministic): more programs where N alone gives too few for the
    SMs (decode batches against a projection of few outputs and many inputs, as a down projection)."""
    m = x.shape[0]
    assert x.stride(1) == 1, x.stride()
    n, k, g, b, flags = check_layout(weight, scales, zeros, g_idx, bias, group_size, x.shape[1])
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    out = y if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    flags.update(M_MAJOR=m <= SMALL_M, SPLIT_K=split_k, HAS_BIAS=flags["HAS_BIAS"] and split_k == 1)
    strides = (x.stride(0), weight.stride(0), out.stride(-2), out.stride(0) if split_k > 1 else 0)
    args = (x, weight, scales, zeros, g, b, out, m, n, k, scales.shape[1], *strides, m_tile(m))

    def grid(meta):
        tiles = (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
        return (*(tiles if flags["M_MAJOR"] else tiles[::-1]), split_k)

    pdl = pdl_options(x.device, release_after_loop=True)
    if config is not None:
        _gemm_kernel.fn[grid(config.kwargs)](*args, **flags, **config.all_kwargs(), **pdl)
    elif x.is_cuda:
        _gemm_kernel[grid](*args, **flags, **pdl)
    else:
        _gemm_kernel.fn[grid(dict(BLOCK_M=16, BLOCK_N=16))](
            *args, **flags, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, PDL=0
        )
    if split_k == 1:
        return y
    total = out.sum(0)
    if bias is not None:
        total += bias
    return y.copy_(total)
