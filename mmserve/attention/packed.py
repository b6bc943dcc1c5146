"""Attention within packed segments, as vision towers use it: the tokens of several pictures, frames or windows
in one sequence, each segment attending only to itself (block-diagonal, no mask, no cache).

On CUDA in fp16 / bf16 one variable-length flash-attention call covers every segment (cu_seqlens); elsewhere,
and as the reference, one SDPA call per run of consecutive equal-length segments.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmserve.core.transfer import to_device

try:  # torch >= 2.9
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the variable-length flash kernel serves tensors of this device and dtype."""
    return (
        varlen_attn is not None
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
    )


@dataclass(frozen=True)
class PackedSegments:
    """The segments' lengths (host; they sum to the token count) and, where the varlen kernel runs, their
    cumulative starts cu_seqlens [S + 1] int32 on the device and the longest length."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor | None = None
    max_len: int = 0

    @classmethod
    def build(
        cls, lengths: Sequence[int], device: torch.device, dtype: torch.dtype, varlen: bool = True
    ) -> PackedSegments:
        """Segments of `lengths` for q / k / v of `dtype` on `device`; varlen False keeps the SDPA runs."""
        lengths = tuple(int(n) for n in lengths)
        if not (varlen and lengths and varlen_available(device, dtype)):
            return cls(lengths)
        cu = to_device([0, *itertools.accumulate(lengths)], torch.int32, device)
        return cls(lengths, cu, max(lengths))


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: PackedSegments, scale: float
) -> torch.Tensor:
    """q, k, v [N, H, D] (last dim contiguous) of consecutive segments, each attending only itself
    -> [N, H * D]."""
    n, heads, head_dim = q.shape
    if segments.cu_seqlens is not None:
        cu, m = segments.cu_seqlens, segments.max_len
        if scale == head_dim**-0.5:  # the kernel's default; older torch takes no scale argument
            o = varlen_attn(q, k, v, cu, cu, m, m)
        else:
            o = varlen_attn(q, k, v, cu, cu, m, m, scale=scale)
        return o.reshape(n, heads * head_dim)
    return sdpa_runs(q, k, v, segments.lengths, scale)


def sdpa_runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int], scale: float
) -> torch.Tensor:
    """The reference: one SDPA call per run of consecutive equal-length segments -> [N, H * D]."""
    heads, head_dim = q.shape[1:]
    out, start = [], 0
    for length, run in itertools.groupby(lengths):  # equal segments attend as one batch
        m = len(list(run))
        qs, ks, vs = (
            t[start : start + m * length].view(m, length, heads, head_dim).transpose(1, 2)
            for t in (q, k, v)
        )  # [m, H, length, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
        out.append(o.transpose(1, 2).reshape(m * length, heads * head_dim))
        start += m * length
    return out[0] if len(out) == 1 else torch.cat(out)
