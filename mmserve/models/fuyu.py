"""Fuyu (HF `FuyuForCausalLM`): no vision tower — each 30×30 patch of the picture is one linear projection
(`vision_embed_tokens`) written over an image token; a Persimmon decoder reads them with the text.

The processor lays a picture out as rows of `|SPEAKER|` image tokens, each row ended by a `|NEWLINE|` token (a
plain token, embedded as such). Each row is one MultiModalItem here: a contiguous run of image tokens with its
patches, keyed by the picture's hash and the row, so the runner's chunking and caches work per row unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.linear import ReplicatedLinear
from mmserve.models.base import MultiModalCausalLM, check_single_image
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.persimmon import PersimmonModel
from mmserve.models.registry import register_family
from mmserve.models.weights import load_weights

# checkpoint prefix -> our module path: transformers >= 5 layout; the hub layout (adept/fuyu-8b) is ours already
WEIGHT_RENAMES = [
    ("model.language_model.", "language_model.model."),
    ("model.vision_embed_tokens.", "vision_embed_tokens."),
    ("lm_head.", "language_model.lm_head."),
]


def image_token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `token` in ids, in order."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


@register_family(
    FamilySpec(
        name="fuyu",
        architectures=("FuyuForCausalLM",),
        model_types=("fuyu",),
        prompt=PromptFormat(
            image_token=None
        ),  # its processor lays the picture's patch rows out first
        client=ClientFormat("fuyu"),
        placeholder_in_prompt=False,  # the processor lays out the picture's tokens itself
    )
)
class FuyuForCausalLM(MultiModalCausalLM):
    """Picture rows of image tokens -> linear patch embeddings; everything else is the Persimmon decoder."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        patch = config.patch_size * config.patch_size * config.num_channels
        self.vision_embed_tokens = ReplicatedLinear(patch, self.text_config.hidden_size, bias=True)
        self.language_model = LlamaForCausalLM(
            self.text_config, backbone=PersimmonModel(self.text_config)
        )

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """One item per row of the picture's image tokens, with that row's patches [row width, 3 * 30 * 30]."""
        check_single_image(image_keys, video_keys, required=False)
        if not image_keys:
            return []
        patches = enc["pixel_values"] if "pixel_values" in enc else enc["image_patches"]
        patches = patches[0] if isinstance(patches, (list, tuple)) else patches
        patches = patches.reshape(-1, patches.shape[-1])
        runs = image_token_runs(ids, hf_config.image_token_id)
        if sum(n for _, n in runs) != len(patches):
            raise ValueError(
                f"the prompt has {sum(n for _, n in runs)} image tokens for {len(patches)} patches"
            )
        items, start = [], 0
        for row, (offset, n) in enumerate(runs):
            items.append(
                MultiModalItem(
                    "image",
                    {"patches": patches[start : start + n]},
                    offset,
                    n,
                    f"{image_keys[0]}:row{row}",
                )
            )
            start += n
        return items

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Each row's patches through the one linear: [row width, text_hidden] per item."""
        return list(self.vision_embed_tokens(torch.stack([it.data["patches"] for it in items])))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = bool(getattr(self.text_config, "tie_word_embeddings", False))
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("rotary_emb.inv_freq",) + (("lm_head.",) if tied else ()),
        )
