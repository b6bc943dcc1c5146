"""CLIP vision tower (ViT with class token and learned positions), returning any layer's hidden states."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.activation import get_act_fn
from mmserve.layers.linear import ReplicatedLinear


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            config.patch_size,
            config.patch_size,
            bias=False,
        )
        num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, config.hidden_size)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values [N, 3, H, W] -> [N, 1 + patches, hidden]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(patches), 1, -1)
        x = torch.cat([cls, patches], dim=1)
        return x + self.position_embedding.weight[: x.shape[1]]


class CLIPAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.q_proj = ReplicatedLinear(h, h, bias=True)
        self.k_proj = ReplicatedLinear(h, h, bias=True)
        self.v_proj = ReplicatedLinear(h, h, bias=True)
        self.out_proj = ReplicatedLinear(h, h, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        q, k, v = (
            p(x).view(n, s, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(o.transpose(1, 2).reshape(n, s, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = ReplicatedLinear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    """Pre-LN ViT block; `attention` lets towers with another attention layout (BLIP-2's fused qkv) reuse it."""

    def __init__(self, config, attention: type[nn.Module] = CLIPAttention) -> None:
        super().__init__()
        self.self_attn = attention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )


class CLIPVisionTower(nn.Module):
    """Runs only as many layers as the deepest requested feature layer needs."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, feature_layers: list[int]) -> list[torch.Tensor]:
        """Hidden states at HF `hidden_states` indices (0 = embeddings, -1 = last layer), [N, S, hidden] each."""
        num_layers = len(self.encoder.layers)
        wanted = [l % (num_layers + 1) for l in feature_layers]
        states = {0: None}
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states[0] = x
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = layer(x)
            states[i] = x
        return [states[w] for w in wanted]
