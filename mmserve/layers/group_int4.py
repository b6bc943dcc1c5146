"""Group-wise int4 weights: round-to-nearest quantization per group of input columns, and the two published
checkpoint layouts (AutoAWQ's GEMM layout, AutoGPTQ / GPTQModel's "gptq" layout) packed and unpacked.

A weight W [N, K] (N output rows, K input columns) is held as q [N, K] in 0..15 with, per row and group of
`group_size` consecutive columns (G = K / group_size groups), a scale s and a zero point z:

    W[n, k] ~= (q[n, k] - z[n, g(k)]) * s[n, g(k)],   g(k) = k // group_size  (or g_idx[k]: GPTQ act-order)

The rounding error of one element is at most s / 2 (RTN with the group's min and max mapped to 0 and 15).

Layouts (int32 words of 8 nibbles, nibble i at bits 4i..4i+3):
- AWQ (AutoAWQ GEMM, "version": "gemm"): qweight int32 [K, N / 8] and qzeros int32 [G, N / 8] packed along N,
  word c holding columns 8c + [0, 2, 4, 6, 1, 3, 5, 7] in nibbles 0..7; scales fp16 [G, N]; zeros as they are.
- GPTQ ("checkpoint_format": "gptq"): qweight int32 [K / 8, N] packed along K in order (nibble j of word i: row
  8i + j); qzeros int32 [G, N / 8] packed along N in order, each holding zero - 1 (readers add 1 back, so a
  stored nibble 15 reads as 16 and a zero of 0 has no encoding); scales fp16 [G, N]; g_idx int32 [K].
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
PACK_BLOCK = 16  # input columns per block of the layers' own layout (`pack_nibbles_k`)
INT4_LEVELS = 15


def quantize_groups(
    weight: torch.Tensor, group_size: int = 128, zero_point: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 per group of `group_size` input columns: (q uint8 [N, K] in 0..15, scales fp32
    [N, K / group_size], zeros uint8 [N, K / group_size]) with W ~= (q - zeros) * scales. Asymmetric (the group's
    min and max map to 0 and 15) with `zero_point`, else symmetric (max |w| maps to 7 or -8, zeros all 8).
    group_size -1 (or K): one group per row."""
    n, k = weight.shape
    group_size = k if group_size in (-1, k) else group_size
    if group_size <= 0 or k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    w = weight.float().reshape(n, k // group_size, group_size)
    if zero_point:
        lo = w.amin(dim=2).clamp(max=0.0)
        hi = w.amax(dim=2).clamp(min=0.0)
        scales = ((hi - lo) / INT4_LEVELS).clamp(min=1e-10)
        zeros = torch.round(-lo / scales).clamp(0, INT4_LEVELS)
    else:
        scales = (w.abs().amax(dim=2) / 7.5).clamp(
            min=1e-10
        )  # +-7.5 s covers -8..7 levels around 8
        zeros = torch.full_like(scales, 8.0)
    q = torch.round(w / scales[..., None] + zeros[..., None]).clamp(0, INT4_LEVELS)
    return q.reshape(n, k).to(torch.uint8), scales, zeros.to(torch.uint8)


def group_index(k: int, group_size: int, device: torch.device | None = None) -> torch.Tensor:
    """g(k) = k // group_size for columns 0..k-1 (int64 [K]); group_size -1: all in group 0."""
    return torch.arange(k, device=device) // (k if group_size == -1 else group_size)


def dequantize_groups(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W [N, K] in `dtype` = (q - zeros[:, g]) * scales[:, g] with g = g_idx (GPTQ act-order: column k uses group
    g_idx[k]) or k // group_size; computed in fp32. zeros may be uint8 or float (GPTQ's may read 16)."""
    # made on q's device: no host copy (a CUDA graph may be capturing)
    g = g_idx if g_idx is not None else group_index(q.shape[1], group_size, q.device)
    g = g.to(device=q.device, dtype=torch.long)
    w = (q.float() - zeros.float()[:, g]) * scales.float()[:, g]
    return w.to(dtype)


def pack_words(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C / 8] from nibbles [R, C]: nibble i of word c holds column 8c + order[i]."""
    r, c = values.shape
    if c % 8:
        raise ValueError(f"{c} columns do not pack into int32 words of 8 nibbles")
    v = values.to(torch.int64).reshape(r, c // 8, 8)[..., list(order)] & 0xF
    word = (v << (4 * torch.arange(8, device=values.device))).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_words(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint8 [R, C] nibbles from int32 [R, C / 8] (the inverse of `pack_words`)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = (w[..., None] >> (4 * torch.arange(8, device=words.device))) & 0xF  # [R, C/8, position]
    inverse = [order.index(j) for j in range(8)]
    return nib[..., inverse].reshape(words.shape[0], -1).to(torch.uint8)


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM-layout tensors {"qweight": int32 [K, N / 8], "qzeros": int32 [G, N / 8], "scales": fp16
    [G, N]} from q [N, K], zeros [N, G] (0..15) and scales [N, G]."""
    return {
        "qweight": pack_words(q.t(), AWQ_ORDER),
        "qzeros": pack_words(zeros.t(), AWQ_ORDER),
        "scales": scales.t().to(torch.float16).contiguous(),
    }


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K], zeros uint8 [N, G], scales fp32 [N, G]) from AutoAWQ GEMM-layout tensors."""
    return (
        unpack_words(qweight, AWQ_ORDER).t().contiguous(),
        unpack_words(qzeros, AWQ_ORDER).t().contiguous(),
        scales.float().t().contiguous(),
    )


def pack_gptq(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """GPTQ ("checkpoint_format": "gptq") tensors {"qweight": int32 [K / 8, N], "qzeros": int32 [G, N / 8]
    (zero - 1 stored), "scales": fp16 [G, N], "g_idx": int32 [K]} from q [N, K], zeros [N, G] (1..16) and
    scales [N, G]; g_idx defaults to k // (K / G). ValueError for a zero of 0 (no encoding in this format)."""
    if bool((zeros == 0).any()):
        raise ValueError(
            "GPTQ's checkpoint_format 'gptq' stores zero - 1 in 4 bits: a zero point of 0 has no encoding"
        )
    k, g = q.shape[1], zeros.shape[1]
    if g_idx is None:
        g_idx = group_index(k, k // g)
    stored = (zeros.to(torch.int64) - 1) & 0xF
    return {
        "qweight": pack_words(q).t().contiguous(),  # [N, K / 8] packed along K, stored transposed
        "qzeros": pack_words(stored.t()),
        "scales": scales.t().to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q uint8 [N, K], zeros uint8 [N, G] (stored + 1: 1..16), scales fp32 [N, G], g_idx int64 [K] or None) from
    GPTQ-layout tensors."""
    q = unpack_words(qweight.t().contiguous())  # [N, K]
    zeros = (unpack_words(qzeros) + 1).t().contiguous()
    return (
        q,
        zeros,
        scales.float().t().contiguous(),
        None if g_idx is None else g_idx.to(torch.long),
    )


def pack_nibbles_k(q: torch.Tensor) -> torch.Tensor:
    """The layers' own layout (layers/group_quant_linear.py): uint8 [N, ceil(K / 16) * 8] from q [N, K] in 0..15 (K a
    multiple of 8; a last half block is padded with zeros). Byte j (0..7) of block b holds column 16b + j in its low
    nibble and column 16b + 8 + j in its high one, so the low nibbles of a block's bytes meet 8 contiguous
    activations and the high nibbles the next 8 (kernels/group_int4_gemm.py loads each half as one vector)."""
    n, k = q.shape
    if k % (PACK_BLOCK // 2):
        raise ValueError(f"group-wise int4 packs input columns in halves of {PACK_BLOCK}, got {k}")
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, -k % PACK_BLOCK))
    blocks = q.reshape(n, -1, 2, PACK_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, -1)


def unpack_nibbles_k(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """q uint8 [N, K] in 0..15 from the layers' layout (the inverse of `pack_nibbles_k`); `k` drops the padding."""
    n = packed.shape[0]
    blocks = packed.reshape(n, -1, PACK_BLOCK // 2)
    q = torch.stack([blocks & 0xF, blocks >> 4], dim=2).reshape(n, -1)
    return q if k is None else q[:, :k]
