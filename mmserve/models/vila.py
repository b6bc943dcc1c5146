"""VILA (NVlabs; `Efficient-Large-Model/VILA1.5-*`): a SigLIP (or CLIP) tower, a projector and a Llama decoder, each
in its own sub-folder of the published checkpoint.

The top `config.json` (`LlavaLlamaModel`, model_type `llava_llama`) names the parts; `llm/` is a Llama checkpoint with
its tokenizer, `vision_tower/` a `SiglipVisionModel` (CLIP for the older ones) with its image processor and
`mm_projector/` the projector: `mlp_downsample` (VILA 1.5: each 2×2 block of the tower's grid concatenated, then
LayerNorm → Linear → GELU → Linear; 196 tokens for a 384-px picture), `mlp2x_gelu` or `linear`. There is no HF
processor; `models/vila_processor.py` tokenizes as VILA does. The facts follow NVlabs/VILA (`llava/model/
llava_arch.py`, `multimodal_projector/base_projector.py`, `multimodal_encoder/vision_encoder.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

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
from mmserve.models.siglip import SiglipVisionTower
from mmserve.models.weights import iter_safetensors, load_weights

SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
    "helpful, detailed, and polite answers to the user's questions."
)
# VILA splices pictures in at IMAGE_TOKEN_INDEX = -200, an id with no embedding; this id stands in for each of a
# picture's tokens in our prompt ids (its embedding is overwritten by the picture's)
PLACEHOLDER_ID = 0
PARTS = ("llm", "vision_tower", "mm_projector")
_TOWERS = {"siglip_vision_model": SiglipVisionTower, "clip_vision_model": CLIPVisionTower}


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"VILA checkpoint: {path} is missing") from None


def downsample_2x2(x: torch.Tensor) -> torch.Tensor:
    """[n, L, C] tower features on a square grid → [n, ⌈√L/2⌉², 4C]: the grid zero-padded to even sides, each 2×2
    block's features concatenated ((r, c), (r, c+1), (r+1, c), (r+1, c+1)), blocks column-pair major
    (base_projector.DownSampleBlock.flat_square)."""
    n, length, c = x.shape
    side = int(round(length**0.5))
    x = x.reshape(n, side, side, c)
    if side % 2:
        x = torch.cat([x, x.new_zeros(n, 1, side, c)], dim=1)
        x = torch.cat([x, x.new_zeros(n, side + 1, 1, c)], dim=2)
        side += 1
    x = x.reshape(n, side, side // 2, 2 * c).permute(0, 2, 1, 3)
    return x.reshape(n, (side // 2) ** 2, 4 * c)


class VilaProjector(nn.Module):
    """`mlp_downsample` (2×2 downsample, LayerNorm, Linear, GELU, Linear), `mlp2x_gelu` or `linear`."""

    KINDS = ("mlp_downsample", "mlp2x_gelu", "linear")

    def __init__(self, kind: str, vision_hidden: int, text_hidden: int) -> None:
        super().__init__()
        if kind not in self.KINDS:
            raise ValueError(
                f"VILA mm_projector_type {kind!r} is not supported; supported: {', '.join(self.KINDS)}"
            )
        self.kind = kind
        width = 4 * vision_hidden if kind == "mlp_downsample" else vision_hidden
        self.norm = nn.LayerNorm(width) if kind == "mlp_downsample" else None
        self.linear_1 = ReplicatedLinear(width, text_hidden, bias=True)
        self.act = get_act_fn("gelu")
        self.linear_2 = (
            ReplicatedLinear(text_hidden, text_hidden, bias=True) if kind != "linear" else None
        )

    def renames(self) -> list[tuple[str, str]]:
        """The checkpoint's `mm_projector.layers.<i>.` (nn.Sequential indices) → ours."""
        indices = {
            "mlp_downsample": (2, 4, 1),
            "mlp2x_gelu": (0, 2, None),
            "linear": (None, None, None),
        }
        first, second, norm = indices[self.kind]
        if self.kind == "linear":  # a bare nn.Linear, saved as `mm_projector.weight` / `.bias`
            return [("mm_projector.", "mm_projector.linear_1.")]
        pairs = [(first, "linear_1"), (second, "linear_2"), (norm, "norm")]
        return [
            (f"mm_projector.layers.{i}.", f"mm_projector.{ours}.")
            for i, ours in pairs
            if i is not None
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(downsample_2x2(x))
        x = self.linear_1(x)
        if self.linear_2 is not None:
            x = self.linear_2(self.act(x))
        return x


VILA = FamilySpec(
    name="vila",
    architectures=("LlavaLlamaModel", "LlavaLlamaForCausalLM"),
    model_types=("vila", "llava_llama"),
    prompt=PromptFormat("<image>", SYSTEM + " USER: ", " ASSISTANT:", image_sep="\n"),
    client=ClientFormat("vila", preprocessed=True, video=False),
    encoder_cuda_graphs=True,
)


@register_family(VILA)
class VilaForCausalLM(MultiModalCausalLM):
    """Each picture's tower features (layer `mm_vision_select_layer`; CLS dropped for "patch") through the
    projector replace its run of placeholder ids; several pictures per prompt, interleaved with the text."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        self.feature_layer = int(config.mm_vision_select_layer)
        self.select = config.mm_vision_select_feature
        if self.select not in ("patch", "cls_patch"):
            raise ValueError(f"VILA mm_vision_select_feature {self.select!r} is not supported")
        tower = _TOWERS.get(config.vision_config.model_type)
        if tower is None:
            raise ValueError(
                f"VILA vision tower {config.vision_config.model_type!r} is not supported; "
                f"supported: {', '.join(_TOWERS)}"
            )
        self.vision_tower = tower(config.vision_config)
        self.mm_projector = VilaProjector(
            config.mm_projector_type,
            config.vision_config.hidden_size,
            config.text_config.hidden_size,
        )
        self.language_model = LlamaForCausalLM(config.text_config)
        self.weight_renames = [
            ("llm.model.", "language_model.model."),
            ("llm.lm_head.", "language_model.lm_head."),
            ("vision_tower.vision_tower.vision_model.", "vision_tower."),
            ("vision_tower.vision_tower.", "vision_tower."),
            *self.mm_projector.renames(),
        ]

    @classmethod
    def load_config(cls, model_dir: str) -> Any:
        """The top config.json's VILA fields, with `text_config` (llm/), `vision_config` (vision_tower/) and the
        projector type (mm_projector/) read from the sub-folders."""
        from transformers import AutoConfig, PretrainedConfig

        root = Path(model_dir)
        top = _read(root / "config.json")
        for part in PARTS:
            if not (root / part / "config.json").is_file():
                raise ValueError(
                    f"VILA checkpoint {model_dir}: no {part}/config.json (the published layout has "
                    f"sub-folders {', '.join(PARTS)})"
                )
        projector = _read(root / "mm_projector" / "config.json")
        config = PretrainedConfig(
            architectures=list(top.get("architectures") or ["LlavaLlamaModel"]),
            mm_vision_select_layer=top.get("mm_vision_select_layer", -2),
            mm_vision_select_feature=top.get("mm_vision_select_feature", "patch"),
            image_aspect_ratio=top.get("image_aspect_ratio", "resize"),
            mm_projector_type=projector.get("mm_projector_type", "mlp2x_gelu"),
            image_token_index=PLACEHOLDER_ID,
        )
        config.model_type = "llava_llama"
        config.text_config = AutoConfig.from_pretrained(root / "llm")
        config.vision_config = AutoConfig.from_pretrained(root / "vision_tower")
        config.tie_word_embeddings = getattr(config.text_config, "tie_word_embeddings", False)
        quantization = top.get("quantization_config") or getattr(
            config.text_config, "quantization_config", None
        )  # the language model's (llm/), as `mmserve quantize` writes it in both places
        if quantization is not None:
            config.quantization_config = quantization
        return config

    @classmethod
    def checkpoint_weights(cls, model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The three sub-folders' safetensors, named as VILA's own module holds them (`llm.`,
        `vision_tower.vision_tower.`, `mm_projector.`)."""
        prefixes = {
            "llm": "llm.",
            "vision_tower": "vision_tower.vision_tower.",
            "mm_projector": "mm_projector.",
        }
        for part, prefix in prefixes.items():
            for name, tensor in iter_safetensors(Path(model_dir) / part):
                yield prefix + name, tensor

    @classmethod
    def build_processor(cls, model_dir: str, hf_config: Any) -> Any:
        from mmserve.models.vila_processor import VilaProcessor

        return VilaProcessor.from_checkpoint(model_dir, hf_config, tokens_per_image(hf_config))

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """Each picture's span, as the processor placed it, and its pixel_values [3, H, W]."""
        if video_keys:
            raise ValueError("this model does not take video input")
        spans = enc["image_spans"]
        return [
            MultiModalItem("image", {"pixel_values": enc["pixel_values"][k]}, off, n, image_keys[k])
            for k, (off, n) in enumerate(spans)
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        pixels = torch.stack([it.data["pixel_values"] for it in items])
        (states,) = self.vision_tower(pixels, [self.feature_layer])
        if self.select == "patch":  # the first position (CLIP's CLS), whatever the tower
            states = states[:, 1:]
        out = list(self.mm_projector(states))
        for item, emb in zip(items, out):
            if len(emb) != item.length:
                raise ValueError(
                    f"image gives {len(emb)} embeddings but the prompt has {item.length} placeholders"
                )
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = self.config.tie_word_embeddings
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("rotary_emb.inv_freq", "position_ids", "vision_model.head.")
            + (("lm_head.",) if tied else ()),
        )


def tokens_per_image(config: Any) -> int:
    """The embeddings one picture gives: the tower's outputs (a CLIP tower's CLS first; "patch" drops the first
    output whatever the tower, as VILA's `feature_select` does), for `mlp_downsample` a square grid halved per
    side, rounded up."""
    v = config.vision_config
    side = v.image_size // v.patch_size
    n = (
        side * side
        + (v.model_type == "clip_vision_model")
        - (config.mm_vision_select_feature == "patch")
    )
    if config.mm_projector_type != "mlp_downsample":
        return n
    if round(n**0.5) ** 2 != n:
        raise ValueError(
            f"VILA mlp_downsample needs a square grid of tower features, got {n} "
            f"(mm_vision_select_feature {config.mm_vision_select_feature!r})"
        )
    return ((round(n**0.5) + 1) // 2) ** 2
