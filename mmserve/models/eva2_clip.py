"""CogVLM's vision side: the EVA2-CLIP tower, CogVLM2's 2×2 downsampling convolution, the GLU projector and the
`boi` / `eoi` rows around a picture's features (THUDM's `visual.py`: `EVA2CLIPModel`, `PatchEmbedding`,
`TransformerLayer`, `GLU`).

The tower's layers are post-norm: `x + LN(attention(x))`, then `x + LN(mlp(x))` (the norm on the branch's
output); attention is full, over a fused q/k/v with bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.linear import ReplicatedLinear

GLU_NORM_EPS = 1e-5  # GLU.norm1 is a default nn.LayerNorm


class PatchEmbedding(nn.Module):
    def __init__(self, v) -> None:
        super().__init__()
        self.proj = nn.Conv2d(v.in_channels, v.hidden_size, v.patch_size, v.patch_size)
        self.cls_embedding = nn.Parameter(torch.empty(1, v.hidden_size), requires_grad=False)
        self.position_embedding = nn.Embedding(v.num_positions, v.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.proj(pixels.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_embedding.expand(len(x), 1, -1), x], dim=1)
        return x + self.position_embedding.weight[None, : x.shape[1]]


class EvaAttention(nn.Module):
    def __init__(self, v) -> None:
        super().__init__()
        self.heads = v.num_heads
        self.query_key_value = ReplicatedLinear(v.hidden_size, 3 * v.hidden_size, bias=True)
        self.dense = ReplicatedLinear(v.hidden_size, v.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        q, k, v = self.query_key_value(x).view(n, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.dense(out.transpose(1, 2).reshape(n, s, d))


class EvaMLP(nn.Module):
    def __init__(self, v) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(v.hidden_size, v.intermediate_size, bias=True)
        self.fc2 = ReplicatedLinear(v.intermediate_size, v.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EvaLayer(nn.Module):
    def __init__(self, v) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)
        self.attention = EvaAttention(v)
        self.mlp = EvaMLP(v)
        self.post_attention_layernorm = nn.LayerNorm(v.hidden_size, eps=v.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.input_layernorm(self.attention(x))
        return x + self.post_attention_layernorm(self.mlp(x))


class EvaTransformer(nn.Module):
    def __init__(self, v) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EvaLayer(v) for _ in range(v.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class GLU(nn.Module):
    """linear_proj → LayerNorm → GELU → silu(gate_proj) · dense_h_to_4h → dense_4h_to_h (no biases)."""

    def __init__(self, in_features: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.linear_proj = ReplicatedLinear(in_features, hidden, bias=False)
        self.norm1 = nn.LayerNorm(hidden, eps=GLU_NORM_EPS)
        self.gate_proj = ReplicatedLinear(hidden, intermediate, bias=False)
        self.dense_h_to_4h = ReplicatedLinear(hidden, intermediate, bias=False)
        self.dense_4h_to_h = ReplicatedLinear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(self.linear_proj(x)))
        return self.dense_4h_to_h(F.silu(self.gate_proj(x)) * self.dense_h_to_4h(x))


class EVA2CLIPModel(nn.Module):
    """Pixels [N, 3, S, S] → [N, rows, text_hidden]: boi, the projected patch features (CogVLM2: after a 2×2
    stride-2 convolution over the grid), eoi."""

    def __init__(
        self, vision_config, text_hidden: int, text_intermediate: int, downsample: bool
    ) -> None:
        super().__init__()
        v = vision_config
        self.patch_embedding = PatchEmbedding(v)
        self.transformer = EvaTransformer(v)
        self.conv = nn.Conv2d(v.hidden_size, v.hidden_size, 2, 2) if downsample else None
        self.linear_proj = GLU(v.hidden_size, text_hidden, text_intermediate)
        self.boi = nn.Parameter(torch.empty(1, 1, text_hidden), requires_grad=False)
        self.eoi = nn.Parameter(torch.empty(1, 1, text_hidden), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.transformer(self.patch_embedding(pixels))[:, 1:]
        if self.conv is not None:
            n, s, d = x.shape
            side = int(round(s**0.5))
            x = self.conv(x.transpose(1, 2).reshape(n, d, side, side)).flatten(2).transpose(1, 2)
        x = self.linear_proj(x)
        n = len(x)
        return torch.cat([self.boi.expand(n, 1, -1), x, self.eoi.expand(n, 1, -1)], dim=1)
