"""Pix2Struct / Deplot (HF `Pix2StructForConditionalGeneration`): a ViT over variable-resolution patches whose
output a T5-style decoder attends through every layer's cross-attention.

The processor scales the picture so that as many 16x16 patches as fit `max_patches` keep its aspect ratio, and
flattens each patch with its 1-based (row, column) in front; rows past the picture's patches are zeros (padding,
masked out of every attention). In VQA checkpoints (Deplot: `is_vqa`) the question is rendered as a header above
the picture, so the text is the encoder's input and the decoder starts from its start token alone; otherwise the
text is the beginning of the decoder's answer. The tower runs on the picture's patches only (the padding rows are
keys no real row attends), so what it yields per picture is every decoder layer's cross keys/values over them.

Both stacks are T5-like: RMS LayerNorms, unscaled attention scores, gated-GELU feed-forward; the decoder (a
`t5.T5LanguageModel` without a text encoder) adds T5's relative-position bias in its self-attention. The header
font: `MediaConfig.header_font_path`, else `Arial.TTF` in the checkpoint, else the hub cache's copy of the font
transformers downloads (`ybelkada/fonts`), else Pillow's built-in font (a warning: the model was trained on Arial).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.functional import pil_to_tensor

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.activation import get_act_fn
from mmserve.layers.linear import ReplicatedLinear
from mmserve.layers.norm import RMSNorm
from mmserve.models.base import CrossKVLayout, EncoderDecoderLM, check_single_image
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat, TextShape
from mmserve.models.registry import register_family, register_text_shape
from mmserve.models.t5 import T5LanguageModel
from mmserve.models.weights import load_weights

logger = logging.getLogger(__name__)

# checkpoint decoder names -> ours (t5.T5LanguageModel's), after the "decoder." prefix
_DECODER_RENAMES = [
    (r"^embed_tokens\.", "shared."),
    (r"^layer\.(\d+)\.self_attention\.attention\.", r"decoder.block.\1.layer.0.SelfAttention."),
    (r"^layer\.(\d+)\.self_attention\.layer_norm\.", r"decoder.block.\1.layer.0.layer_norm."),
    (
        r"^layer\.(\d+)\.encoder_decoder_attention\.attention\.",
        r"decoder.block.\1.layer.1.EncDecAttention.",
    ),
    (
        r"^layer\.(\d+)\.encoder_decoder_attention\.layer_norm\.",
        r"decoder.block.\1.layer.1.layer_norm.",
    ),
    (r"^layer\.(\d+)\.mlp\.", r"decoder.block.\1.layer.2."),
    (r"^final_layer_norm\.", "decoder.final_layer_norm."),
    (r"^lm_head\.", "lm_head."),
]
_PROJECTIONS = {"query": "q", "key": "k", "value": "v", "output": "o"}


def decoder_name(name: str) -> str:
    """Our module path of a checkpoint tensor of the text decoder (`decoder.*`)."""
    rest = name[len("decoder.") :]
    for pattern, repl in _DECODER_RENAMES:
        new, n = re.subn(pattern, repl, rest)
        if n:
            new = re.sub(
                r"(SelfAttention|EncDecAttention)\.(query|key|value|output)\.",
                lambda m: f"{m.group(1)}.{_PROJECTIONS[m.group(2)]}.",
                new,
            )
            return "language_model." + new
    return "language_model." + rest


def t5_view(text_config) -> SimpleNamespace:
    """The text config under the names `t5.T5LanguageModel` reads (the decoder's feed-forward is always gated)."""
    return SimpleNamespace(
        vocab_size=text_config.vocab_size,
        d_model=text_config.hidden_size,
        d_kv=text_config.d_kv,
        d_ff=text_config.d_ff,
        num_heads=text_config.num_heads,
        num_layers=text_config.num_layers,
        num_decoder_layers=None,
        is_gated_act=True,
        dense_act_fn=text_config.dense_act_fn,
        relative_attention_num_buckets=text_config.relative_attention_num_buckets,
        relative_attention_max_distance=text_config.relative_attention_max_distance,
        layer_norm_epsilon=text_config.layer_norm_epsilon,
        tie_word_embeddings=False,
    )


class Pix2StructVisionAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.heads, self.d_kv = config.num_attention_heads, config.d_kv
        inner = self.heads * self.d_kv
        self.query = ReplicatedLinear(config.hidden_size, inner, bias=False)
        self.key = ReplicatedLinear(config.hidden_size, inner, bias=False)
        self.value = ReplicatedLinear(config.hidden_size, inner, bias=False)
        self.output = ReplicatedLinear(inner, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            p(x).view(len(x), self.heads, self.d_kv).transpose(0, 1)
            for p in (self.query, self.key, self.value)
        )
        o = F.scaled_dot_product_attention(
            q[None], k[None], v[None], scale=1.0
        )  # T5-style: unscaled scores
        return self.output(o[0].transpose(0, 1).reshape(len(x), -1))


class Pix2StructVisionMlp(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.wi_0 = ReplicatedLinear(config.hidden_size, config.d_ff, bias=False)
        self.wi_1 = ReplicatedLinear(config.hidden_size, config.d_ff, bias=False)
        self.wo = ReplicatedLinear(config.d_ff, config.hidden_size, bias=False)
        self.act = get_act_fn(config.dense_act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))


class Pix2StructVisionLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = Pix2StructVisionAttention(config)
        self.mlp = Pix2StructVisionMlp(config)
        self.pre_attention_layer_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.pre_mlp_layer_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.pre_attention_layer_norm(x))
        return x + self.mlp(self.pre_mlp_layer_norm(x))


class Pix2StructVisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_projection = ReplicatedLinear(
            config.patch_embed_hidden_size, config.hidden_size, bias=True
        )
        self.row_embedder = nn.Embedding(config.seq_len, config.hidden_size)
        self.column_embedder = nn.Embedding(config.seq_len, config.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        rows, cols = patches[:, 0].long(), patches[:, 1].long()
        return (
            self.patch_projection(patches[:, 2:])
            + self.row_embedder(rows)
            + self.column_embedder(cols)
        )


class Pix2StructVisionEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            Pix2StructVisionLayer(config) for _ in range(config.num_hidden_layers)
        )


class Pix2StructVisionTower(nn.Module):
    """One picture's real patches [N, 2 + patch values] (row, column, values) -> states [N, hidden]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = Pix2StructVisionEmbeddings(config)
        self.encoder = Pix2StructVisionEncoder(config)
        self.layernorm = RMSNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(patches)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)


@register_family(
    FamilySpec(
        name="pix2struct",
        architectures=("Pix2StructForConditionalGeneration",),
        model_types=("pix2struct",),
        prompt=PromptFormat(
            image_token=None
        ),  # Deplot: the text is the question drawn on the picture
        client=ClientFormat("pix2struct"),
        attention="encoder_decoder",
        placeholder_in_prompt=False,
        encoder_reads_text=True,  # VQA checkpoints: the question is drawn on the picture (module docstring)
        cross_decode_graphs=True,
    )
)
class Pix2StructForConditionalGeneration(EncoderDecoderLM):
    """The vision tower + the T5-style decoder with cross-attention (Deplot, Pix2Struct, MatCha checkpoints)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        self.encoder = Pix2StructVisionTower(config.vision_config)
        self.language_model = T5LanguageModel(
            t5_view(config.text_config), with_encoder=False, output_scale=1.0
        )
        for p in self.parameters():
            p.requires_grad_(False)

    @classmethod
    def decoder_prompt_ids(cls, hf_config, tokenizer: Any, text: str) -> list[int]:
        """The start token; in a captioning (non-VQA) checkpoint, then the client's text as the answer's start."""
        start = hf_config.decoder_start_token_id
        if start is None:
            start = hf_config.text_config.decoder_start_token_id
        if getattr(hf_config, "is_vqa", False) or not text:
            return [start]
        return [start] + tokenizer(text, add_special_tokens=False).input_ids

    @classmethod
    def processor_kwargs(
        cls, model_dir: str, hf_config, header_font_path: str | None
    ) -> dict[str, Any]:
        """What every processor call needs (`call_processor` takes it): the header's font, VQA checkpoints only."""
        if not getattr(hf_config, "is_vqa", False):
            return {}
        return header_font(model_dir, header_font_path)

    @classmethod
    def call_processor(cls, processor: Any, text: str, kwargs: dict[str, Any]) -> Any:
        """The HF processor's outputs for one picture and its text, at the checkpoint's `max_patches` (the
        processor's call would take 2048 whatever the checkpoint says). A VQA header is drawn by the image
        processor's own `render_header` in the font of `processor_kwargs`, which the processor's call does not pass
        on (it fetches Arial from the hub), then the picture is processed as a non-VQA one."""
        kwargs = dict(kwargs)
        font = {k: kwargs.pop(k) for k in ("font_bytes", "font_path") if k in kwargs}
        image_processor = processor.image_processor
        images = kwargs.pop("images")
        if not image_processor.is_vqa:
            return processor(
                images=images,
                text=text or None,
                return_tensors="pt",
                max_patches=image_processor.max_patches,
                **kwargs,
            )
        drawn = [
            image_processor.render_header(pil_to_tensor(im.convert("RGB")), text, **font)
            for im in images
        ]
        return image_processor(
            drawn,
            is_vqa=False,
            max_patches=image_processor.max_patches,
            return_tensors="pt",
            **kwargs,
        )

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        check_single_image(image_keys, video_keys, required=True)
        patches, mask = enc["flattened_patches"][0], enc["attention_mask"][0]
        key = image_keys[0]
        if getattr(hf_config, "is_vqa", False):  # the encoder sees the question too
            key += ":" + hashlib.sha256(enc.get("encoder_text", "").encode()).hexdigest()[:32]
        real = patches[mask.bool()].contiguous()  # the processor pads after the picture's patches
        return [MultiModalItem("image", {"flattened_patches": real}, 0, 1, key, kv_from=0)]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Per picture: the tower's states over its patches, [patches, hidden]."""
        dtype = self.encoder.layernorm.weight.dtype
        # pictures have as many patches as their aspect ratio gives: one at a time
        return [self.encoder(item.data["flattened_patches"].to(dtype)) for item in items]

    def cross_kv(self, encoded: torch.Tensor) -> torch.Tensor:
        """Every decoder layer's cross keys/values (this rank's heads), [patches, layers, 2, heads, d_kv]."""
        return self.language_model.cross_kv(encoded)

    def cross_kv_layout(self) -> CrossKVLayout:
        return self.language_model.cross_kv_layout()

    def cross_kv_tokens(self, item: MultiModalItem) -> int:
        """The picture's real patches."""
        return item.data["flattened_patches"].shape[0]

    def lora_target_ok(self, module_name: str) -> bool:
        return (
            ".EncDecAttention." not in module_name
        )  # its k/v run on the encoder states, once per picture

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen: set[str] = set()

        def renamed():
            for name, tensor in weights:
                name = decoder_name(name) if name.startswith("decoder.") else name
                seen.add(name)
                yield name, tensor

        load_weights(self, renamed())
        self.language_model.share_head_if_absent(seen)


def header_font(model_dir: str, font_path: str | None) -> dict[str, Any]:
    """Image-processor kwargs (`font_path` or `font_bytes`) of the font VQA headers are drawn in (`font_path`: a
    file MediaConfig has checked)."""
    if font_path is not None:
        return {"font_path": font_path}
    local = os.path.join(model_dir, "Arial.TTF")
    if os.path.isfile(local):
        return {"font_path": local}
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache("ybelkada/fonts", "Arial.TTF")
    except Exception:  # no hub cache to look in
        cached = None
    if isinstance(cached, str) and os.path.isfile(cached):
        return {"font_path": cached}
    logger.warning(
        "no Arial.TTF (the font Pix2Struct VQA models read their question in) in %s, the hub cache or "
        "--header-font: drawing questions in Pillow's built-in font",
        model_dir,
    )
    return {"font_bytes": builtin_font_bytes()}


def builtin_font_bytes() -> bytes:
    """Pillow's built-in TrueType font (Pillow >= 10.1 embeds one), as bytes."""
    from PIL import ImageFont

    font = ImageFont.load_default(size=12)
    data = getattr(font, "font_bytes", None)
    if not data:
        raise RuntimeError(
            "this Pillow has no built-in TrueType font; give a font file (--header-font)"
        )
    return data


@register_text_shape("pix2struct_text_model")
def pix2struct_text_shape(text: dict) -> TextShape:
    """T5-style names with its own hidden_size; the MLP is always gated."""
    heads = int(text["num_heads"])
    return TextShape(
        hidden=int(text["hidden_size"]),
        layers=int(text["num_layers"]),
        heads=heads,
        head_dim=int(text["d_kv"]),
        vocab=int(text["vocab_size"]),
        intermediate=int(text["d_ff"]),
        kv_heads=heads,
        mlp_matrices=3,
        cross_attention=True,
    )
