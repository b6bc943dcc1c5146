"""Qwen2-VL / Qwen2.5-VL vision tower: patch embedding, ViT blocks with 2D (h, w) rotary, 2x2 patch merger.

Patches of all images in a batch are packed into one sequence; attention stays within each frame of
each image or video (block-diagonal: attention/packed.py, one varlen flash call per block on CUDA). Qwen2.5-VL:
RMSNorm, gated MLP, and all but `fullatt_block_indexes` attend within windows of the frame. The indices a
batch of grids needs (window order, segment starts, rotary positions) are built once per grids and kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.attention.packed import PackedSegments, packed_attention
from mmserve.core.transfer import to_device
from mmserve.layers.activation import SiluAndMul, get_act_fn
from mmserve.layers.linear import ReplicatedLinear, default_weight_loader
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import _rotate_half


def vision_rope_positions(grid_thw: list[list[int]], merge: int) -> torch.Tensor:
    """(h, w) patch coordinates [N, 2] in the processor's patch order: frame, merge block row/col, in-block row/col."""
    out = []
    for t, h, w in grid_thw:
        hh = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        ww = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: patches of one merge block are adjacent
        hw = torch.stack([hh.transpose(1, 2).flatten(), ww.transpose(1, 2).flatten()], dim=-1)
        out.append(hw.repeat(t, 1))
    return torch.cat(out)


def window_order(
    grid_thw: list[list[int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL windows: merged-token order that groups each frame's tokens window by window (window x
    window merged tokens, partial at the right/bottom edges), and the windows' lengths in patches."""
    order, seqlens, base = [], [], 0
    for t, h, w in grid_thw:
        h, w = h // merge, w // merge
        ph, pw = -h % window, -w % window
        idx = F.pad(torch.arange(t * h * w).view(t, h, w), (0, pw, 0, ph), value=-1)
        idx = idx.view(t, (h + ph) // window, window, (w + pw) // window, window).permute(
            0, 1, 3, 2, 4
        )
        idx = idx.reshape(t, -1, window * window)  # [t, windows, window²]
        seqlens += [int(c) * merge * merge for c in (idx >= 0).sum(-1).flatten() if c]
        idx = idx.flatten()
        order.append(idx[idx >= 0] + base)
        base += t * h * w
    return torch.cat(order), seqlens


@dataclass
class VisionRope:
    """The 2D rotary of one tower call. On CUDA: positions [2, N] (h, w) on the device and the module's
    [max_pos, head_dim / 2] cos / sin tables, which the fused Triton rotary reads per frequency through
    `axis` (first half of the frequencies: row, second half: column). Elsewhere: cos, sin [N, head_dim]."""

    positions: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    axis: torch.Tensor | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q, k [N, H, D] (in fp32, rounded back to their dtype, as transformers does)."""
        if (
            self.axis is not None
        ):  # in place, one kernel instead of ~10 elementwise ones over fp32 copies
            from mmserve.kernels.fused_ops import apply_rotary_

            return apply_rotary_(self.positions, q, k, self.cos, self.sin, self.axis)
        cos, sin = self.cos[:, None], self.sin[:, None]
        return (
            (q.float() * cos + _rotate_half(q.float()) * sin).to(q.dtype),
            (k.float() * cos + _rotate_half(k.float()) * sin).to(k.dtype),
        )

    def permute(self, perm: torch.Tensor) -> "VisionRope":
        """The rotary of the tokens reordered by perm (a device index)."""
        if self.axis is not None:
            return VisionRope(self.positions[:, perm].contiguous(), self.cos, self.sin, self.axis)
        return VisionRope(None, self.cos[perm], self.sin[perm])


class VisionRotary(nn.Module):
    """2D RoPE: the first half of each head's rotary frequencies follows the row, the second the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        dim = head_dim // 2
        self.register_buffer(
            "inv_freq",
            1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)),
            persistent=False,
        )
        half = len(self.inv_freq)
        self.register_buffer(
            "axis", torch.arange(2 * half) // half, persistent=False
        )  # [head_dim / 2]: 0 h, 1 w
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, pos: torch.Tensor, device: torch.device) -> VisionRope:
        """pos [N, 2] (host) -> the rotary for tokens on `device`."""
        if device.type == "cuda":
            cos, sin = self.tables(int(pos.max()) + 1 if len(pos) else 1)
            return VisionRope(
                to_device(pos.T.contiguous(), torch.int64, device), cos, sin, self.axis
            )
        pos = pos.to(device)
        freqs = (pos[..., None].float() * self.inv_freq.float()).flatten(
            1
        )  # [N, 2 * dim/2]: h freqs, w freqs
        emb = torch.cat((freqs, freqs), dim=-1)
        return VisionRope(None, emb.cos(), emb.sin())

    def tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, head_dim / 2] of positions 0..P-1 (P a power of two >= num_positions), built on the device
        once and kept: the same products pos * inv_freq in fp32 as forward's, so the same bits."""
        if self._tables is None or len(self._tables[0]) < num_positions:
            size = 1 << max(num_positions - 1, 1).bit_length()
            inv = torch.cat((self.inv_freq, self.inv_freq)).float()
            freqs = torch.arange(size, device=inv.device, dtype=torch.float)[:, None] * inv[None, :]
            self._tables = (freqs.cos(), freqs.sin())
        return self._tables


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = ReplicatedLinear(dim, 3 * dim, bias=True)
        self.proj = ReplicatedLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, segments: PackedSegments, rope: VisionRope) -> torch.Tensor:
        # x [N, dim]; segments: the packed attention segments (lengths sum to N)
        n = len(x)
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D] each
        q, k = rope.apply(q, k)
        return self.proj(packed_attention(q, k, v, segments, self.head_dim**-0.5))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(dim, hidden, bias=True)
        self.act = get_act_fn(act)
        self.fc2 = ReplicatedLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GateUpLinear(ReplicatedLinear):
    """gate_proj and up_proj of one input as one matmul, whole on every rank; the checkpoint's parts load by
    shard id (0: gate, 1: up), as load_weights' packed modules name them."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__(dim, 2 * hidden, bias)
        self.hidden = hidden

    def _out_rows(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id is None:
            return 0, self.out_features, 0
        return int(shard_id) * self.hidden, self.hidden, 0

    def full_rows(self, shard_id: object = None) -> int:
        return self.out_features if shard_id is None else self.hidden

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        offset, size, _ = self._out_rows(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), loaded)


class VisionGatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(dim, hidden, bias=True)
        self.silu_and_mul = SiluAndMul() if act == "silu" else None  # one fused kernel on CUDA
        self.act = get_act_fn(act)
        self.down_proj = ReplicatedLinear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate_up_proj(x)  # [N, 2 * hidden]: gate | up
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(y))
        gate, up = y.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def _is_qwen2_5(config) -> bool:
    return config.model_type == "qwen2_5_vl_vision"


class ResidualLayerNorm(nn.LayerNorm):
    """nn.LayerNorm with RMSNorm's residual interface: norm(x), or (norm(x + residual), x + residual)."""

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


def _norm(dim: int, rms: bool) -> nn.Module:
    return RMSNorm(dim, 1e-6) if rms else ResidualLayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """Pre-norm ViT block; the residual add rides in the next norm (one fused kernel for RMSNorm on CUDA)."""

    def __init__(self, config, dim: int) -> None:
        super().__init__()
        qwen2_5 = _is_qwen2_5(config)
        self.norm1, self.norm2 = _norm(dim, qwen2_5), _norm(dim, qwen2_5)
        if qwen2_5:
            self.mlp = VisionGatedMLP(dim, config.intermediate_size, config.hidden_act)
        else:
            self.mlp = VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)
        self.attn = VisionAttention(dim, config.num_heads)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        segments: PackedSegments,
        rope: VisionRope,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous block's MLP output (the embeddings at the first block, residual None), residual the
        stream before it -> (this block's MLP output, the stream before it)."""
        h, residual = (self.norm1(x), x) if residual is None else self.norm1(x, residual)
        h, residual = self.norm2(self.attn(h, segments, rope), residual)
        return self.mlp(h), residual


class PatchMerger(nn.Module):
    """Norm, then each merge x merge block of patches (adjacent rows) -> one text-sized embedding."""

    def __init__(self, text_hidden: int, dim: int, merge: int, rms_norm: bool) -> None:
        super().__init__()
        self.in_dim = dim * merge * merge
        self.ln_q = _norm(dim, rms_norm)
        self.mlp = nn.Sequential(
            ReplicatedLinear(self.in_dim, self.in_dim, bias=True),
            nn.GELU(),
            ReplicatedLinear(self.in_dim, text_hidden, bias=True),
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last block's MLP output and the stream before it -> [N / merge², text_hidden]."""
        return self.mlp(self.ln_q(x, residual)[0].view(-1, self.in_dim))


@dataclass(frozen=True)
class TowerPlan:
    """What the tower needs for one batch of grids, on the device: built once per grids and kept."""

    rope: VisionRope  # the tokens' rotary, in the order the blocks see them
    frames: PackedSegments  # one segment per frame
    windows: PackedSegments  # Qwen2.5-VL's windows (the frames again for Qwen2-VL)
    perm: torch.Tensor | None  # Qwen2.5-VL: patch rows in window order
    unperm: torch.Tensor | None  # Qwen2.5-VL: merged rows back to the processor's order


PLAN_CACHE_SIZE = (
    32  # distinct batches of grids kept (a few KB of indices each, plus their positions)
)


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        qwen2_5 = _is_qwen2_5(config)
        if qwen2_5:  # ViT width and text width: Qwen2.5-VL names them hidden_size / out_hidden_size
            dim, text_hidden = config.hidden_size, config.out_hidden_size
        else:  # Qwen2-VL: embed_dim / hidden_size
            dim, text_hidden = config.embed_dim, config.hidden_size
        self.merge = config.spatial_merge_size
        self.in_channels, self.patch, self.temporal = (
            config.in_channels,
            config.patch_size,
            config.temporal_patch_size,
        )
        # Qwen2.5-VL: window side in merged tokens, and the blocks that still attend over the whole frame
        self.window = config.window_size // self.merge // self.patch if qwen2_5 else None
        self.full_blocks = (
            set(config.fullatt_block_indexes) if qwen2_5 else set(range(config.depth))
        )
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(config.in_channels, dim, kernel, kernel, bias=False)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        self.rotary = VisionRotary(dim // config.num_heads, theta)
        self.blocks = nn.ModuleList(VisionBlock(config, dim) for _ in range(config.depth))
        self.merger = PatchMerger(text_hidden, dim, self.merge, rms_norm=qwen2_5)
        for p in self.parameters():
            p.requires_grad_(False)
        self.varlen = True  # False: one SDPA call per run of equal segments even where varlen runs
        self._plans: dict[tuple, TowerPlan] = {}

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[list[int]]) -> torch.Tensor:
        """pixel_values [N, C * T * P * P] (patches of all items, in order), grid_thw one (t, h, w) per item
        -> [N / merge², text_hidden]."""
        weight = (
            self.patch_embed.proj.weight
        )  # [dim, C, T, P, P]: the kernel covers a whole patch, a matmul
        x = F.linear(pixel_values.to(weight.dtype), weight.view(len(weight), -1))  # [N, dim]
        plan = self.plan(grid_thw, x.device, x.dtype)
        if plan.perm is not None:  # merge blocks window by window (frames stay contiguous)
            x = x[plan.perm]
        residual = None
        for i, block in enumerate(self.blocks):
            segments = plan.frames if i in self.full_blocks else plan.windows
            x, residual = block(x, residual, segments, plan.rope)
        x = self.merger(x, residual)
        return x if plan.unperm is None else x[plan.unperm]

    def plan(
        self, grid_thw: list[list[int]], device: torch.device, dtype: torch.dtype
    ) -> TowerPlan:
        """The batch's TowerPlan, from the cache when these grids were seen (no host work, no copies)."""
        key = (tuple(tuple(int(v) for v in g) for g in grid_thw), device, dtype, self.varlen)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLAN_CACHE_SIZE:
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = self._build_plan(key[0], device, dtype)
        return plan

    def _build_plan(
        self, grid_thw: tuple[tuple[int, int, int], ...], device: torch.device, dtype: torch.dtype
    ) -> TowerPlan:
        # host-built index tensors go up pinned: a pageable copy would wait for the steps queued on the GPU
        pos = vision_rope_positions(grid_thw, self.merge)  # [N, 2]
        frames = [h * w for t, h, w in grid_thw for _ in range(t)]
        if self.window is None:
            segments = PackedSegments.build(frames, device, dtype, self.varlen)
            return TowerPlan(self.rotary(pos, device), segments, segments, None, None)
        order, window_lengths = window_order(grid_thw, self.merge, self.window)
        unit = self.merge**2
        perm = (order[:, None] * unit + torch.arange(unit)).flatten()
        return TowerPlan(
            self.rotary(pos[perm], device),
            PackedSegments.build(frames, device, dtype, self.varlen),
            PackedSegments.build(window_lengths, device, dtype, self.varlen),
            to_device(perm, torch.int64, device),
            to_device(torch.argsort(order), torch.int64, device),
        )
