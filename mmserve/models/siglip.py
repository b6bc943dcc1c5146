"""SigLIP vision tower (ViT without class token; learned positions), returning any layer's hidden states.

Its encoder layers have CLIP's exact structure and parameter names, so they are CLIP's modules.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.models.clip import CLIPEncoder


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, config.patch_size, bias=True
        )
        self.position_embedding = nn.Embedding(
            (config.image_size // config.patch_size) ** 2, config.hidden_size
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values [N, 3, H, W] -> [N, patches, hidden]; H = W = image_size (no position interpolation)
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        if patches.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(
                f"SigLIP got {patches.shape[1]} patches per image but has "
                f"{self.position_embedding.num_embeddings} positions (wrong image size)"
            )
        return patches + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    """Runs only as many layers as the deepest requested feature layer needs.

    `post_layernorm` is loaded but not applied: HF's `hidden_states[-1]` is the last layer's output before it.
    An attention-pooling `head` (vision_use_head) is never used by the LLaVA families and is not built.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, feature_layers: list[int]) -> list[torch.Tensor]:
        """Hidden states at HF `hidden_states` indices (0 = embeddings, -1 = last layer), [N, S, hidden] each."""
        num_layers = len(self.encoder.layers)
        wanted = [l % (num_layers + 1) for l in feature_layers]
        x = self.embeddings(pixel_values)
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers[: max(wanted)], start=1):
            x = layer(x)
            states[i] = x
        return [states[w] for w in wanted]
