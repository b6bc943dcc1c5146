"""Pixtral family: `LlavaForConditionalGeneration` checkpoints whose vision tower is Pixtral's (pixtral_vision)
+ the LLaVA projector + a Mistral/Llama text model (e.g. mistral-community/pixtral-12b).

The processor scales each image to patch multiples (at most `longest_edge`) and writes it into the prompt as rows
of `[IMG]` tokens, each row closed by `[IMG_BREAK]`, the last by `[IMG_END]`. One item covers an image's whole
run; its embeddings are the image's features at the `[IMG]` positions and the text embeddings of the closing
tokens at theirs, so the runner's merge writes the run as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.core.transfer import to_device
from mmserve.layers.rotary import RotaryEmbedding, rope_inv_freq
from mmserve.models.base import MultiModalCausalLM
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.llava import LlavaProjector
from mmserve.models.pixtral_vision import PixtralVisionTower
from mmserve.models.registry import register_family
from mmserve.models.weights import load_weights

# checkpoint prefix -> our module path; transformers >= 5 layout first, then the published layout (which is ours)
WEIGHT_RENAMES = [
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
]


def _pixtral_tower(cfg) -> bool:
    return getattr(getattr(cfg, "vision_config", None), "model_type", "") == "pixtral"


@register_family(
    FamilySpec(
        name="pixtral",
        architectures=("LlavaForConditionalGeneration",),  # a LLaVA config with Pixtral's tower
        config_matches=_pixtral_tower,
        model_types=("pixtral",),
        prompt=PromptFormat("[IMG]"),
        client=ClientFormat("pixtral", padded_sizes=True, video=False),
    )
)
class PixtralForConditionalGeneration(MultiModalCausalLM):
    """One image of h x w patches -> h * (w + 1) embeddings: each row's w image features, then its closing token."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = tc = config.text_config
        vc = config.vision_config
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        if config.vision_feature_select_strategy != "full":
            raise ValueError(
                f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} does not fit "
                "a Pixtral tower (it has no class token to drop): use 'full'"
            )
        window = getattr(tc, "sliding_window", None)
        if window is not None and window < tc.max_position_embeddings:
            raise ValueError(
                f"sliding-window attention (window {window}) is not supported by this backbone"
            )
        self.vision_tower = PixtralVisionTower(vc)
        self.multi_modal_projector = LlavaProjector(
            vc.hidden_size * len(self.feature_layers),
            tc.hidden_size,
            config.projector_hidden_act,
            getattr(config, "multimodal_projector_bias", True),
        )
        # one rotary table for all layers: pixtral-12b allows 1,024,000 positions, ~1 GB of fp32 cos / sin per table
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        inv_freq, scaling = rope_inv_freq(tc, head_dim)
        rotary = RotaryEmbedding(inv_freq, tc.max_position_embeddings, scaling)
        self.language_model = LlamaForCausalLM(tc, rotary=rotary)

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """Each image's run of `[IMG]` rows; data: its pixel_values [3, h, w] cropped from the processor's padded
        batch to the image's own size, and row_end_ids [rows] (the prompt's `[IMG_BREAK]` ... `[IMG_END]`)."""
        if video_keys:
            raise ValueError(
                f"videos: this model takes images only, got {len(video_keys)} video(s)"
            )
        if not image_keys:
            return []
        vc = hf_config.vision_config
        patch, image_token = vc.patch_size, hf_config.image_token_index
        pixels, sizes = (
            enc["pixel_values"],
            enc["image_sizes"],
        )  # [N, 3, H_max, W_max], [N, 2] = (h, w)
        if pixels.dim() != 4 or len(pixels) != len(image_keys) or len(sizes) != len(image_keys):
            raise ValueError(
                f"pixel_values: expected [{len(image_keys)}, 3, H, W] with one image_sizes row per "
                f"image, got {list(pixels.shape)} and {list(sizes.shape)}"
            )
        items, start = [], 0
        for k, key in enumerate(image_keys):
            h, w = int(sizes[k][0]), int(sizes[k][1])
            check_image_size(k, h, w, patch, vc.image_size, tuple(pixels.shape[-2:]))
            rows, cols = h // patch, w // patch
            offset, row_ends = image_run(ids, image_token, start, rows, cols, k)
            items.append(
                MultiModalItem(
                    "image",
                    {"pixel_values": pixels[k, :, :h, :w].contiguous(), "row_end_ids": row_ends},
                    offset,
                    rows * (cols + 1),
                    key,
                )
            )
            start = offset + rows * (cols + 1)
        if image_token in ids[start:]:
            raise ValueError(
                f"images: the prompt has more image placeholder tokens (id {image_token}) than its "
                f"{len(image_keys)} image(s) need"
            )
        return items

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode all images in one packed tower call. Returns one [length, text_hidden] tensor per item."""
        images = [it.data["pixel_values"] for it in items]
        states = self.vision_tower(images, self.feature_layers)
        feats = self.multi_modal_projector(torch.cat(states, dim=-1))  # [all patches, text_hidden]
        grids = [
            (
                im.shape[-2] // self.vision_tower.patch_size,
                im.shape[-1] // self.vision_tower.patch_size,
            )
            for im in images
        ]
        ends = torch.cat([it.data["row_end_ids"] for it in items])
        ends = self.embed_input_ids(to_device(ends, torch.int64, feats.device)).to(feats.dtype)
        out = []
        for item, f, e, (rows, cols) in zip(
            items, feats.split([r * c for r, c in grids]), ends.split([r for r, _ in grids]), grids
        ):
            emb = torch.cat([f.view(rows, cols, -1), e[:, None]], dim=1).view(rows * (cols + 1), -1)
            if len(emb) != item.length:
                raise ValueError(
                    f"image gives {len(emb)} embeddings but the prompt has {item.length} placeholders"
                )
            out.append(emb)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = any(
            getattr(c, "tie_word_embeddings", False) for c in (self.config, self.text_config)
        )
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("rotary_emb.inv_freq", "position_ids", "patch_positional_embedding.")
            + (("lm_head.",) if tied else ()),
        )


def check_image_size(
    index: int, h: int, w: int, patch: int, max_side: int, padded: tuple[int, int]
) -> None:
    """ValueError naming image `index` when its processed size (h, w) is empty, not patch-aligned, larger than
    the tower's image_size or than the padded pixel batch."""
    if h < patch or w < patch or h % patch or w % patch:
        raise ValueError(
            f"image_sizes: image {index} is {w}x{h} pixels after processing; Pixtral needs both sides "
            f"to be positive multiples of the patch size {patch}"
        )
    if max(h, w) > max_side:
        raise ValueError(
            f"image_sizes: image {index} is {w}x{h} pixels after processing; this model's vision "
            f"tower takes at most {max_side} pixels a side (vision_config.image_size)"
        )
    if h > padded[0] or w > padded[1]:
        raise ValueError(
            f"pixel_values: image {index} is {w}x{h} pixels but the batch is only "
            f"{padded[1]}x{padded[0]}"
        )


def image_run(
    ids: list[int], image_token: int, start: int, rows: int, cols: int, index: int
) -> tuple[int, torch.Tensor]:
    """(offset, row_end_ids [rows]) of image `index`'s run in `ids`: its first `[IMG]` at or after `start`, then
    `rows` rows of `cols` `[IMG]` tokens, each closed by one other token. ValueError if the prompt disagrees."""
    try:
        offset = ids.index(image_token, start)
    except ValueError:
        raise ValueError(
            f"images: the prompt has no image placeholder tokens (id {image_token}) left for image "
            f"{index}"
        ) from None
    length = rows * (cols + 1)
    run = torch.tensor(ids[offset : offset + length], dtype=torch.int64)
    if len(run) != length:
        raise ValueError(
            f"images: image {index} needs {length} prompt tokens ({rows} rows of {cols} + 1) but "
            f"the prompt ends after {len(run)}"
        )
    grid = run.view(rows, cols + 1)
    if not bool((grid[:, :cols] == image_token).all()) or bool(
        (grid[:, cols] == image_token).any()
    ):
        raise ValueError(
            f"images: the prompt's tokens for image {index} are not {rows} rows of {cols} image "
            f"tokens (id {image_token}), each closed by a row-end token"
        )
    return offset, grid[:, cols].clone()
