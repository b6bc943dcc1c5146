"""Llama 3.2 Vision (Mllama) tiled ViT: a local transformer over each image's tiles, then a gated global one.

Mirrors transformers' `MllamaVisionModel` (parameter names included, so `model.vision_model.X` checkpoint
tensors load by stripping the prefix), with images as the batch: [N, tiles, C, H, W] -> [N, tiles, patches, out].
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.linear import ReplicatedLinear
from mmserve.models.clip import CLIPMLP
from mmserve.models.weights import load_weights

PAD_MULTIPLE = (
    8  # each tile's sequence (class token + patches) is zero-padded to a multiple of this
)


class MllamaPrecomputedAspectRatioEmbedding(nn.Module):
    """One learned vector per (aspect ratio id, tile), added to every token of the tile, gated by tanh(gate)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.max_num_tiles, self.hidden_size = config.max_num_tiles, config.hidden_size
        self.embedding = nn.Embedding(
            config.max_aspect_ratio_id + 1, self.max_num_tiles * self.hidden_size
        )
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        # x [N, tiles, S, hidden]; aspect_ratio_ids [N]
        emb = self.embedding(aspect_ratio_ids).reshape(-1, self.max_num_tiles, 1, self.hidden_size)
        return x + emb * self.gate.tanh()


class MllamaPrecomputedPositionEmbedding(nn.Module):
    """(1 - tanh(gate)) * per-patch positions + tanh(gate) * per-(aspect ratio id, tile, patch) positions."""

    def __init__(self, config) -> None:
        super().__init__()
        self.max_num_tiles, self.hidden_size = config.max_num_tiles, config.hidden_size
        self.num_patches = (config.image_size // config.patch_size) ** 2 + 1
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(self.num_patches, self.hidden_size))
        self.tile_embedding = nn.Embedding(
            config.max_aspect_ratio_id + 1, self.max_num_tiles * self.num_patches * self.hidden_size
        )

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        # x [N, tiles, patches, hidden]; aspect_ratio_ids [N]
        gate = self.gate.tanh()
        x = x + (1 - gate) * self.embedding
        tile = self.tile_embedding(aspect_ratio_ids)
        return x + gate * tile.reshape(-1, self.max_num_tiles, self.num_patches, self.hidden_size)


class MllamaVisionAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.attention_heads
        self.head_dim = h // self.num_heads
        self.q_proj = ReplicatedLinear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = ReplicatedLinear(h, self.num_heads * self.head_dim, bias=False)
        self.v_proj = ReplicatedLinear(h, self.num_heads * self.head_dim, bias=False)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # x [N, S, hidden]; mask [N, 1, S, S] additive
        n, s, _ = x.shape
        q, k, v = (
            p(x).view(n, s, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(n, s, -1))


class MllamaVisionEncoderLayer(nn.Module):
    """Pre-LN block; a gated (global) layer scales each residual branch by tanh of its learned gate."""

    def __init__(self, config, is_gated: bool) -> None:
        super().__init__()
        self.is_gated = is_gated
        self.self_attn = MllamaVisionAttention(config)
        self.mlp = CLIPMLP(config)  # fc1, act, fc2: the same block
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        if is_gated:
            self.gate_attn = nn.Parameter(torch.zeros(1))
            self.gate_ffn = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), mask)
        x = x + (self.gate_attn.tanh() * attn if self.is_gated else attn)
        ffn = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * ffn if self.is_gated else ffn)


class MllamaVisionEncoder(nn.Module):
    def __init__(self, config, num_layers: int, is_gated: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MllamaVisionEncoderLayer(config, is_gated) for _ in range(num_layers)
        )

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, keep: Iterable[int] = ()
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Returns the last output and {i: state} for i in `keep`, state i being the output of layer i."""
        keep, states = set(keep), {}
        for i, layer in enumerate(self.layers):
            x = layer(x, mask)
            if i in keep:
                states[i] = x
        return x, states


def aspect_ratio_attention_bias(
    aspect_ratio_mask: torch.Tensor, num_patches: int, padded_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """HF's `_prepare_aspect_ratio_attention_mask`: an additive [N, 1, S, S] bias over S = tiles * padded_len
    tokens that is finfo.min where BOTH query and key are invalid (padded tile or padding token), else 0.

    So valid queries attend every key, padding included, and invalid queries attend only valid keys. This is
    HF's (and Meta's) behaviour, kept as is. `num_patches` never is a multiple of 8 ((g*g + 1) % 8 is 1, 2 or 5),
    so HF's `[-0:]` slicing corner is never reached.
    """
    n, tiles = aspect_ratio_mask.shape
    token_valid = torch.arange(padded_len, device=aspect_ratio_mask.device) < num_patches  # [L]
    valid = aspect_ratio_mask.to(torch.bool)[:, :, None] & token_valid  # [N, tiles, L]
    invalid = (~valid).reshape(n, tiles * padded_len).to(dtype)
    return (invalid[:, :, None] * invalid[:, None, :] * torch.finfo(dtype).min).unsqueeze(1)


class MllamaVisionTower(nn.Module):
    """Llama 3.2 Vision encoder; the output's last dim is [global output | local intermediates interleaved].

    `intermediate_layers_indices` index the local layers' OUTPUTS (index i = after layer i), as transformers
    5.x computes them. Meta's reference and transformers <= 4.5x took the INPUT of layer i (one layer less);
    `intermediates_are_layer_inputs=True` gives that variant.
    """

    def __init__(self, config, intermediates_are_layer_inputs: bool = False) -> None:
        super().__init__()
        self.config = config
        self.max_num_tiles, self.hidden_size = config.max_num_tiles, config.hidden_size
        self.num_patches = (config.image_size // config.patch_size) ** 2 + 1
        self.padded_len = -(-self.num_patches // PAD_MULTIPLE) * PAD_MULTIPLE
        self.intermediate_layers = list(config.intermediate_layers_indices)
        if intermediates_are_layer_inputs and min(self.intermediate_layers) < 1:
            raise ValueError(
                "intermediate index 0 as a layer input would be the embeddings; not supported"
            )
        self.intermediate_shift = 1 if intermediates_are_layer_inputs else 0
        expected = config.hidden_size * (1 + len(self.intermediate_layers))
        if getattr(config, "vision_output_dim", expected) != expected:
            raise ValueError(
                f"vision_output_dim {config.vision_output_dim} != hidden_size * (1 + "
                f"{len(self.intermediate_layers)} intermediate layers) = {expected}"
            )

        self.patch_embedding = nn.Conv2d(
            config.num_channels,
            config.hidden_size,
            config.patch_size,
            config.patch_size,
            bias=False,
        )
        self.class_embedding = nn.Parameter(torch.zeros(config.hidden_size))
        self.gated_positional_embedding = MllamaPrecomputedPositionEmbedding(config)
        self.pre_tile_positional_embedding = MllamaPrecomputedAspectRatioEmbedding(config)
        self.post_tile_positional_embedding = MllamaPrecomputedAspectRatioEmbedding(config)
        # HF builds these two with nn.LayerNorm's default eps (1e-5), not config.norm_eps
        self.layernorm_pre = nn.LayerNorm(config.hidden_size)
        self.layernorm_post = nn.LayerNorm(config.hidden_size)
        self.transformer = MllamaVisionEncoder(config, config.num_hidden_layers, is_gated=False)
        self.global_transformer = MllamaVisionEncoder(
            config, config.num_global_layers, is_gated=True
        )
        for p in self.parameters():
            p.requires_grad_(False)

    def embed(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        """[N, tiles, C, H, W] -> layernorm_pre'd tokens [N, tiles, num_patches, hidden] (class token first)."""
        n, tiles = pixel_values.shape[:2]
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.flatten(0, 1).to(w.device, w.dtype))
        x = (
            x.flatten(2).transpose(1, 2).reshape(n, tiles, -1, self.hidden_size)
        )  # [N, tiles, patches-1, hidden]
        x = self.pre_tile_positional_embedding(x, aspect_ratio_ids)
        cls = self.class_embedding.expand(n, tiles, 1, self.hidden_size)
        x = torch.cat([cls, x], dim=2)
        x = self.gated_positional_embedding(x, aspect_ratio_ids)
        return self.layernorm_pre(x)

    def forward(
        self,
        pixel_values: torch.Tensor,
        aspect_ratio_ids: torch.Tensor,
        aspect_ratio_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Encode N independent images.

        Args:
            pixel_values: [N, max_num_tiles, C, image_size, image_size]; padded tiles may hold anything.
            aspect_ratio_ids: [N] int, 1 + index into config.supported_aspect_ratios (0 = no image).
            aspect_ratio_mask: [N, max_num_tiles], 1 for the image's real tiles, 0 for padded ones.
        Returns:
            [N, max_num_tiles, num_patches, vision_output_dim], padded tiles included (they are not zero).
            Last dim: global_transformer output (hidden) then the local intermediates stacked on a last axis
            and flattened: feature hidden + d * K + k is dim d of intermediate k (K = len(indices)).
        """
        n, tiles = pixel_values.shape[:2]
        if tiles != self.max_num_tiles:
            raise ValueError(
                f"pixel_values has {tiles} tiles per image; the model's max_num_tiles is {self.max_num_tiles}"
            )
        aspect_ratio_ids = aspect_ratio_ids.reshape(n).to(self.patch_embedding.weight.device)
        p, lp, h = self.num_patches, self.padded_len, self.hidden_size
        x = self.embed(pixel_values, aspect_ratio_ids)
        x = F.pad(x, (0, 0, 0, lp - p))  # zeros after layernorm_pre
        mask = aspect_ratio_attention_bias(
            aspect_ratio_mask.reshape(n, tiles).to(x.device), p, lp, x.dtype
        )

        wanted = [i - self.intermediate_shift for i in self.intermediate_layers]
        x, states = self.transformer(x.reshape(n, tiles * lp, h), mask, keep=wanted)
        x = self.layernorm_post(x).reshape(n, tiles, lp, h)
        x = self.post_tile_positional_embedding(x, aspect_ratio_ids).reshape(n, tiles * lp, h)
        x, _ = self.global_transformer(x, mask)

        x = x.reshape(n, tiles, lp, h)[:, :, :p]
        inter = torch.stack([states[i].reshape(n, tiles, lp, h)[:, :, :p] for i in wanted], dim=-1)
        return torch.cat([x, inter.flatten(-2)], dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs named as inside HF's MllamaVisionModel (`model.vision_model.` stripped)."""
        load_weights(self, weights)
