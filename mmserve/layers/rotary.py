"""Rotary position embedding: 1D, partial (the first dims of each head only: Persimmon / Fuyu), and the multimodal
(t, h, w) M-RoPE of Qwen2-VL; rope scaling via transformers' init functions."""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [head_dim // 2] and the attention scaling factor for a HF text config."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.to(
        torch.get_default_device()
    ), scaling  # models are built under `with torch.device(...)`


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position (the half-split layout of Llama/Qwen checkpoints).

    On CUDA the rotation is a Triton kernel over `cos` / `sin` (and `axis`, for M-RoPE), which attention layers
    also fuse with their KV cache write (kernels/rotary_cache.py)."""

    def __init__(self, inv_freq: torch.Tensor, max_position: int, scaling: float = 1.0) -> None:
        super().__init__()
        t = torch.arange(max_position, dtype=torch.float)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [max_pos, D]
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.register_buffer(
            "axis", None, persistent=False
        )  # M-RoPE's position row (t, h, w) per frequency

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, KVH, D]
        if q.is_cuda:
            from mmserve.kernels.fused_ops import apply_rotary_

            return apply_rotary_(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE: the head's rotary frequencies are split into (t, h, w) sections (`mrope_section`),
    each section rotated by its own position axis."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        max_position: int,
        mrope_section: list[int],
        scaling: float = 1.0,
    ) -> None:
        nn.Module.__init__(self)
        if sum(mrope_section) != len(inv_freq):
            raise ValueError(
                f"mrope_section {list(mrope_section)} must sum to head_dim // 2 = {len(inv_freq)}"
            )
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)  # [max_pos, D/2]
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)
        axis = torch.cat(
            [torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)]
        )
        self.register_buffer("axis", axis, persistent=False)  # [D/2]: which position drives it

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [3, T] (or [T]: text only, all axes equal); q [T, H, D]; k [T, KVH, D]
        if q.is_cuda:
            from mmserve.kernels.fused_ops import apply_rotary_

            return apply_rotary_(positions, q, k, self.cos, self.sin, self.axis)
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        idx = positions[self.axis].T  # [T, D/2]
        cos = self.cos.gather(0, idx).repeat(1, 2).unsqueeze(1).to(q.dtype)  # [T, 1, D]
        sin = self.sin.gather(0, idx).repeat(1, 2).unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class PartialRotaryEmbedding(nn.Module):
    """Rotates only the first `rotary_dim` of each head's dims (half-split within them), the rest pass through.

    In torch on every device: the fused Triton kernels rotate whole heads, so `Attention` gets the rotated q/k."""

    def __init__(self, inv_freq: torch.Tensor, max_position: int, rotary_dim: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_pos, rotary_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, KVH, D]
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        r = self.rotary_dim

        def rotate(x: torch.Tensor) -> torch.Tensor:
            head = x[..., :r]
            return torch.cat((head * cos + _rotate_half(head) * sin, x[..., r:]), dim=-1)

        return rotate(q), rotate(k)
