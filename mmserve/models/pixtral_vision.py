"""Pixtral vision tower (transformers' `PixtralVisionModel`): conv patch embedding without a class token, RMSNorm
`ln_pre`, then pre-RMSNorm blocks with a gated MLP and an axial 2-D rotary over each image's patch grid.

Every image keeps its own patch-aligned size. The patches of all images are packed into one sequence in which
each image attends only its own patches (transformers' block-diagonal mask); that runs as one SDPA batch per
run of equally long images.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from mmserve.attention.packed import PackedSegments, packed_attention
from mmserve.core.transfer import to_device
from mmserve.layers.activation import get_act_fn
from mmserve.layers.linear import ReplicatedLinear
from mmserve.layers.norm import RMSNorm
from mmserve.models.qwen2_vl_vision import VisionRope

NORM_EPS = 1e-5  # fixed in transformers' tower, not in the config


class PixtralRotary(nn.Module):
    """Axial 2-D RoPE. Of a head's D/2 rotary frequencies, the first D/4 are the even-indexed ones of the 1-D
    RoPE of width D and turn with the patch row, the last D/4 are the odd-indexed ones and turn with the column.
    cos / sin tables cover positions 0 .. max_side - 1 (the tower's image_size in patches)."""

    def __init__(self, head_dim: int, theta: float, max_side: int) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        inv = torch.cat((inv[0::2], inv[1::2]))  # [D/2]
        quarter = head_dim // 4
        self.register_buffer(
            "axis", (torch.arange(head_dim // 2) >= quarter).long(), persistent=False
        )  # 0 row, 1 col
        freqs = torch.arange(max_side, dtype=torch.float)[:, None] * inv[None, :]  # [max_side, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, pos: torch.Tensor, device: torch.device) -> VisionRope:
        """pos [N, 2] (row, column) on the host -> the rotary of N patches on `device`."""
        if (
            device.type == "cuda"
        ):  # the fused rotary kernel looks the tables up per frequency through `axis`
            return VisionRope(
                to_device(pos.T.contiguous(), torch.int64, device), self.cos, self.sin, self.axis
            )
        idx = pos.to(device)[:, self.axis]  # [N, D/2]
        cos, sin = self.cos.gather(0, idx), self.sin.gather(0, idx)
        return VisionRope(None, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))


class PixtralAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = ReplicatedLinear(dim, dim, bias=False)
        self.k_proj = ReplicatedLinear(dim, dim, bias=False)
        self.v_proj = ReplicatedLinear(dim, dim, bias=False)
        self.o_proj = ReplicatedLinear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, segments: PackedSegments, rope: VisionRope) -> torch.Tensor:
        n = len(x)
        q, k, v = (
            p(x).view(n, self.num_heads, self.head_dim)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rope.apply(q, k)
        return self.o_proj(packed_attention(q, k, v, segments, self.head_dim**-0.5))


class PixtralMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = ReplicatedLinear(dim, hidden, bias=False)
        self.up_proj = ReplicatedLinear(dim, hidden, bias=False)
        self.down_proj = ReplicatedLinear(hidden, dim, bias=False)
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim = config.hidden_size
        self.attention_norm = RMSNorm(dim, NORM_EPS)
        self.attention = PixtralAttention(dim, config.num_attention_heads)
        self.ffn_norm = RMSNorm(dim, NORM_EPS)
        self.feed_forward = PixtralMLP(dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, segments: PackedSegments, rope: VisionRope) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), segments, rope)
        return x + self.feed_forward(self.ffn_norm(x))


def patch_positions(grids: list[tuple[int, int]]) -> torch.Tensor:
    """(row, column) of every patch [N, 2], images after each other, each row by row."""
    out = []
    for rows, cols in grids:
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        out.append(torch.stack([r.flatten(), c.flatten()], dim=-1))
    return torch.cat(out)


class PixtralVisionTower(nn.Module):
    """Runs only as many blocks as the deepest requested feature layer needs."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.patch_size = config.patch_size
        self.patch_conv = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            config.patch_size,
            config.patch_size,
            bias=False,
        )
        self.ln_pre = RMSNorm(config.hidden_size, NORM_EPS)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(
            PixtralBlock(config) for _ in range(config.num_hidden_layers)
        )
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"vision_config.rope_parameters: rope_type {rope['rope_type']!r} is not supported "
                "(Pixtral's tower uses 'axial')"
            )
        head_dim = config.hidden_size // config.num_attention_heads
        self.rotary = PixtralRotary(
            head_dim,
            rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
            config.image_size // config.patch_size,
        )
        for p in self.parameters():
            p.requires_grad_(False)

    def embed(self, images: list[torch.Tensor]) -> torch.Tensor:
        """Patch embeddings [N, hidden] of images [3, h, w] (h, w multiples of the patch size), packed in order."""
        dtype = self.patch_conv.weight.dtype
        out = []
        for _, group in itertools.groupby(
            images, key=lambda im: im.shape
        ):  # equal shapes share one conv
            group = list(group)
            x = self.patch_conv(torch.stack(group).to(dtype))  # [m, hidden, rows, cols]
            out.append(x.flatten(2).transpose(1, 2).reshape(-1, x.shape[1]))
        return out[0] if len(out) == 1 else torch.cat(out)

    def forward(self, images: list[torch.Tensor], feature_layers: list[int]) -> list[torch.Tensor]:
        """Hidden states [N, hidden] of all images' patches at HF `hidden_states` indices (0 = after ln_pre,
        i = after block i, -1 = the last block), one tensor per requested index."""
        grids = [
            (im.shape[-2] // self.patch_size, im.shape[-1] // self.patch_size) for im in images
        ]
        x = self.ln_pre(self.embed(images))
        rope = self.rotary(patch_positions(grids), x.device)
        segments = PackedSegments.build([rows * cols for rows, cols in grids], x.device, x.dtype)
        num_layers = len(self.transformer.layers)
        wanted = [layer % (num_layers + 1) for layer in feature_layers]
        states = {0: x}
        for i, block in enumerate(self.transformer.layers[: max(wanted)], start=1):
            x = block(x, segments, rope)
            states[i] = x
        return [states[w] for w in wanted]
