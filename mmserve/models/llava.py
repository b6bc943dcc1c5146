"""LLaVA-1.5 family: CLIP vision tower + MLP projector + Llama-style backbone (HF `llava-hf` checkpoints)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.activation import get_act_fn
from mmserve.layers.linear import ReplicatedLinear
from mmserve.models.base import MultiModalCausalLM
from mmserve.models.clip import CLIPVisionTower
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.registry import register_family
from mmserve.models.weights import load_weights
from mmserve.multimodal.placeholder_expansion import equal_runs

# checkpoint prefix -> our module path; HF >= 5 layout first, then the original llava-hf layout
WEIGHT_RENAMES = [
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
]


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = ReplicatedLinear(vision_hidden, text_hidden, bias=bias)
        self.act = get_act_fn(act)
        self.linear_2 = ReplicatedLinear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


LLAVA_PROMPT = PromptFormat("<image>", "USER:\n", " ASSISTANT:")


@register_family(
    FamilySpec(
        name="llava",
        architectures=("LlavaForConditionalGeneration",),
        model_types=("llava",),
        prompt=LLAVA_PROMPT,
        client=ClientFormat("llava", preprocessed=True),
        encoder_cuda_graphs=True,
    )
)
class LlavaForConditionalGeneration(MultiModalCausalLM):
    """One image -> `length` embeddings that replace its `<image>` placeholder tokens."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.select_strategy = config.vision_feature_select_strategy
        if self.select_strategy not in ("default", "full"):
            raise ValueError(
                f"vision_feature_select_strategy {self.select_strategy!r} is not supported"
            )
        self.vision_tower = CLIPVisionTower(config.vision_config)
        self.multi_modal_projector = LlavaProjector(
            config.vision_config.hidden_size * len(self.feature_layers),
            config.text_config.hidden_size,
            config.projector_hidden_act,
            getattr(config, "multimodal_projector_bias", True),
        )
        self.language_model = LlamaForCausalLM(config.text_config)

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """Each image's `<image>` run (all runs equally long) and its pixel_values [3, H, W]."""
        runs = equal_runs(ids, hf_config.image_token_index, len(image_keys))
        return [
            MultiModalItem("image", {"pixel_values": enc["pixel_values"][k]}, off, n, image_keys[k])
            for k, (off, n) in enumerate(runs)
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode images in one batch. Returns one [length, text_hidden] tensor per item."""
        pixels = torch.stack([it.data["pixel_values"] for it in items])  # [N, 3, H, W]
        states = self.vision_tower(pixels, self.feature_layers)
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        feats = self.multi_modal_projector(torch.cat(states, dim=-1))  # [N, S, text_hidden]
        out = list(feats)
        for item, emb in zip(items, out):
            if len(emb) != item.length:
                raise ValueError(
                    f"image gives {len(emb)} embeddings but the prompt has {item.length} placeholders"
                )
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = getattr(self.text_config, "tie_word_embeddings", False) or getattr(
            self.config, "tie_word_embeddings", False
        )
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("rotary_emb.inv_freq", "position_ids") + (("lm_head.",) if tied else ()),
        )
