"""LLaVA-NeXT (llava-v1.6) family: CLIP tower + MLP projector + Llama/Mistral backbone, anyres images.

Each image is a base tile plus a mosaic of tiles (count depends on its size), packed by `anyres`
into a variable number of embeddings that replace its `<image>` run.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mmserve.core.multimodal import MultiModalItem
from mmserve.models.anyres import AnyresSpec
from mmserve.models.base import MultiModalCausalLM
from mmserve.models.clip import CLIPVisionTower
from mmserve.models.family import FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.llava import LlavaProjector
from mmserve.models.registry import register_family
from mmserve.models.siglip import SiglipVisionTower
from mmserve.models.weights import load_weights
from mmserve.multimodal.placeholder_expansion import placeholder_runs

# checkpoint prefix -> our module path; transformers >= 5 layout first, then the original llava-hf layout
WEIGHT_RENAMES = [
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.image_newline", "image_newline"),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
]
MIN_IMAGE_SIDE = (
    4  # pixels; smaller images have no usable anyres geometry (and confuse HF's channel guess)
)

_TOWERS = {"clip_vision_model": CLIPVisionTower, "siglip_vision_model": SiglipVisionTower}


def check_image_size(
    size: tuple[int, int], spec: AnyresSpec, index: int, tiled: bool = True
) -> None:
    """ValueError naming the image if it is too small, or so thin that its tile mosaic keeps no feature row."""
    h, w = size
    if min(h, w) < MIN_IMAGE_SIDE:
        raise ValueError(
            f"image {index} is {w}x{h} pixels; images must be at least "
            f"{MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}"
        )
    if not tiled:
        return
    rows, cols = spec.feature_grid(size)
    if rows < 1 or cols < 1:
        raise ValueError(
            f"image {index} is {w}x{h} pixels: its aspect ratio is too extreme for this model "
            f"(no feature rows left after unpadding)"
        )


@register_family(
    FamilySpec(
        name="llava_next",
        architectures=("LlavaNextForConditionalGeneration",),
        model_types=("llava_next",),
        prompt=PromptFormat(
            "<image>", "[INST] ", " [/INST]", image_sep="\n"
        ),  # the Mistral-based v1.6
    )
)
class LlavaNextForConditionalGeneration(MultiModalCausalLM):
    """One image -> base tile + unpadded mosaic (rows ended by image_newline) embeddings."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        vc = config.vision_config
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.select_strategy = config.vision_feature_select_strategy
        if vc.model_type not in _TOWERS:
            raise ValueError(
                f"vision tower {vc.model_type!r} is not supported; supported: {sorted(_TOWERS)}"
            )
        has_cls = vc.model_type == "clip_vision_model"
        if self.select_strategy != ("default" if has_cls else "full"):
            raise ValueError(
                f"vision_feature_select_strategy {self.select_strategy!r} does not fit a "
                f"{vc.model_type} tower (anyres needs exactly one feature per patch)"
            )
        window = getattr(self.text_config, "sliding_window", None)
        if window is not None and window < self.text_config.max_position_embeddings:
            raise ValueError(
                f"sliding-window attention (window {window}) is not supported by this backbone"
            )
        self.anyres = AnyresSpec.from_config(config)
        self.vision_tower = _TOWERS[vc.model_type](vc)
        self.multi_modal_projector = LlavaProjector(
            vc.hidden_size * len(self.feature_layers),
            self.text_config.hidden_size,
            config.projector_hidden_act,
            getattr(config, "multimodal_projector_bias", True),
        )
        self.image_newline = nn.Parameter(
            torch.empty(self.text_config.hidden_size), requires_grad=False
        )
        self.language_model = LlamaForCausalLM(self.text_config)

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """Each image's `<image>` run, its tiles [num_tiles, 3, H, W] and image_size [2] = (h, w)."""
        return image_items(hf_config, enc, ids, image_keys)

    def encode_tiles(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] -> projected features [N, grid*grid, text_hidden]."""
        states = self.vision_tower(pixels, self.feature_layers)
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def embed_images(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """All tiles of all items in one tower batch, then each image packed to [length, text_hidden]."""
        tiles = [it.data["pixel_values"] for it in items]
        feats = self.encode_tiles(torch.cat(tiles)).split([len(t) for t in tiles])
        return [
            self.anyres.pack(f, tuple(it.data["image_size"].tolist()), self.image_newline)
            for it, f in zip(items, feats)
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Returns one [length, text_hidden] tensor per item."""
        return check_lengths(items, self.embed_images(items))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = any(
            getattr(c, "tie_word_embeddings", False) for c in (self.config, self.text_config)
        )
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=(
                "rotary_emb.inv_freq",
                "position_ids",
                "vision_tower.vision_model.head.",
                "vision_tower.head.",
            )
            + (("lm_head.",) if tied else ()),
        )


def image_items(hf_config, enc, ids: list[int], image_keys: list[str]) -> list[MultiModalItem]:
    """MultiModalItems of the images, lengths counted as HF's processor counts them.

    A sample with several images in one nested list (OneVision's `batch_num_images` > 1) is not tiled:
    each of its images is one base tile plus a newline.
    """
    if not image_keys:
        return []
    spec = AnyresSpec.from_config(hf_config)
    pixels, sizes = enc["pixel_values"], enc["image_sizes"]  # [N, max_tiles, 3, H, W], [N, 2]
    if pixels.dim() != 5 or tuple(pixels.shape[-2:]) != (spec.tile, spec.tile):
        raise ValueError(
            f"expected image tiles [N, T, 3, {spec.tile}, {spec.tile}], got {list(pixels.shape)}"
        )
    per_sample = enc.get("batch_num_images")
    tiled = (
        [True] * len(image_keys)
        if per_sample is None
        else [int(n) == 1 for n in per_sample for _ in range(int(n))]
    )
    lengths, tiles = [], []
    for k in range(len(image_keys)):
        size = (int(sizes[k][0]), int(sizes[k][1]))
        check_image_size(size, spec, k, tiled[k])
        lengths.append(spec.num_tokens(size, tiled[k]))
        tiles.append(spec.num_tiles(size) if tiled[k] else 1)
    offsets = placeholder_runs(ids, hf_config.image_token_index, lengths)
    return [
        MultiModalItem(
            "image",
            {"pixel_values": pixels[k, : tiles[k]], "image_size": sizes[k].long()},
            offsets[k],
            lengths[k],
            image_keys[k] if tiled[k] else f"{image_keys[k]}:base",
        )
        for k in range(len(image_keys))
    ]


def check_lengths(
    items: list[MultiModalItem], embeddings: list[torch.Tensor]
) -> list[torch.Tensor]:
    for item, emb in zip(items, embeddings):
        if len(emb) != item.length:
            raise ValueError(
                f"{item.modality} gives {len(emb)} embeddings but the prompt has "
                f"{item.length} placeholders"
            )
    return embeddings
