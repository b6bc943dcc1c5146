"""Kosmos-2 (HF `Kosmos2ForConditionalGeneration`): a CLIP tower whose normalised states a set of learned latent
queries attends (`image_to_text_projection`), giving the embeddings of the image span the processor puts at the
start of the prompt; a pre-LN decoder with sub-LayerNorms (inside attention before its output projection, inside
the MLP after the activation), scaled token embeddings and fixed sinusoidal positions.

Text positions start at `pad_token_id + 1` (fairseq's convention, which the sinusoid table follows).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.core.multimodal import MultiModalItem
from mmserve.distributed import get_tp_size
from mmserve.layers.activation import get_act_fn
from mmserve.layers.attention import Attention
from mmserve.layers.cross_attention import attend_batched
from mmserve.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mmserve.layers.norm import ShardedLayerNorm
from mmserve.models.base import MultiModalCausalLM, check_single_image
from mmserve.models.clip import CLIPVisionTower
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat, TextShape
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.registry import register_family, register_text_shape
from mmserve.models.weights import load_weights

# checkpoint prefix -> our module path (hub layout first; transformers >= 5 keeps the same names under `model.`)
WEIGHT_RENAMES = [
    ("model.text_model.", "language_model.model."),
    ("text_model.model.", "language_model.model."),
    ("model.vision_model.model.", "vision_model."),
    ("vision_model.model.", "vision_model."),
    ("model.image_to_text_projection.", "image_to_text_projection."),
    ("text_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
]


def sinusoid_table(num_positions: int, dim: int, padding_idx: int | None) -> torch.Tensor:
    """tensor2tensor's sinusoids: row n = [sin(n f_0..f_h), cos(n f_0..f_h)] (a zero column for odd dims), the
    padding row zero."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.float)[:, None] * freqs[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    if padding_idx is not None:
        table[padding_idx] = 0
    return table


class Kosmos2TextAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        dim, heads = config.embed_dim, config.attention_heads
        self.head_dim = dim // heads
        self.qkv_proj = QKVParallelLinear(dim, self.head_dim, heads, heads, bias=True)
        # normalises the whole attention output; under tensor parallelism each rank holds its heads' part
        self.inner_attn_ln = ShardedLayerNorm(dim, eps=config.layer_norm_eps)
        self.out_proj = RowParallelLinear(dim, dim, bias=True)
        local = heads // get_tp_size()
        self.attn = Attention(local, self.head_dim, local, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.inner_attn_ln(self.attn(q, k, v, meta)))


class Kosmos2TextFFN(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config.embed_dim, config.ffn_dim, bias=True)
        self.act = get_act_fn(config.activation_function)
        self.ffn_layernorm = ShardedLayerNorm(
            config.ffn_dim, eps=config.layer_norm_eps
        )  # fc1's columns
        self.fc2 = RowParallelLinear(config.ffn_dim, config.embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ffn_layernorm(self.act(self.fc1(x))))


class Kosmos2TextBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Kosmos2TextAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        self.ffn = Kosmos2TextFFN(config)
        self.final_layer_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), meta)
        return x + self.ffn(self.final_layer_norm(x))


class Kosmos2TextDecoder(nn.Module):
    """Scaled token embeddings (image embeddings included) + sinusoidal positions, pre-LN blocks, final LayerNorm."""

    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("Kosmos-2 text models with cross-attention layers are not supported")
        self.embed_scale = math.sqrt(config.embed_dim) if config.scale_embedding else 1.0
        self.position_offset = (config.pad_token_id if config.pad_token_id is not None else -1) + 1
        self.embed_tokens = nn.Embedding(config.vocab_size, config.embed_dim)
        self.register_buffer(
            "positions",
            sinusoid_table(
                config.max_position_embeddings + self.position_offset + 2,
                config.embed_dim,
                config.pad_token_id,
            ),
            persistent=False,
        )
        self.layers = nn.ModuleList(Kosmos2TextBlock(config) for _ in range(config.layers))
        self.layer_norm = nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = inputs_embeds * self.embed_scale + self.positions[positions + self.position_offset].to(
            inputs_embeds.dtype
        )
        for layer in self.layers:
            x = layer(x, meta)
        return self.layer_norm(x)


class Kosmos2ImageToTextProjection(nn.Module):
    """Learned latent queries attend [projected image states; themselves] once: [N, S, vision] -> [N, Q, text]."""

    def __init__(self, config) -> None:
        super().__init__()
        text = config.text_config
        dim, self.num_heads = text.embed_dim, text.attention_heads
        self.dense = ReplicatedLinear(config.vision_config.hidden_size, dim, bias=True)
        self.latent_query = nn.Parameter(
            torch.empty(config.latent_query_num, dim), requires_grad=False
        )
        self.x_attn = nn.ModuleDict(
            {
                name: ReplicatedLinear(dim, dim, bias=True)
                for name in ("q_proj", "k_proj", "v_proj", "out_proj")
            }
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        latent = self.latent_query.expand(len(features), -1, -1)
        states = torch.cat([self.dense(features), latent], dim=1)
        a = self.x_attn
        return a["out_proj"](
            attend_batched(
                a["q_proj"](latent), a["k_proj"](states), a["v_proj"](states), self.num_heads
            )
        )


@register_family(
    FamilySpec(
        name="kosmos2",
        architectures=("Kosmos2ForConditionalGeneration",),
        model_types=("kosmos-2",),
        prompt=PromptFormat(
            image_token=None
        ),  # its processor puts <image> and the image span first
        client=ClientFormat("kosmos-2"),
        placeholder_in_prompt=False,  # the processor writes <image>, the span and </image> itself
    )
)
class Kosmos2ForConditionalGeneration(MultiModalCausalLM):
    """One image per prompt: its latent-query embeddings fill the image span the processor puts first."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        self.vision_model = CLIPVisionTower(config.vision_config)
        self.image_to_text_projection = Kosmos2ImageToTextProjection(config)
        self.language_model = LlamaForCausalLM(
            self.text_config, backbone=Kosmos2TextDecoder(self.text_config)
        )

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """The image span (where image_embeds_position_mask is 1) and the image's pixel_values [3, H, W]."""
        check_single_image(image_keys, video_keys, required=False)
        if not image_keys:
            return []
        span = [i for i, m in enumerate(enc["image_embeds_position_mask"][0].tolist()) if m]
        if (
            not span
            or span[-1] - span[0] != len(span) - 1
            or len(span) != hf_config.latent_query_num
        ):
            raise ValueError(
                f"the image span has {len(span)} positions; the model gives {hf_config.latent_query_num}"
            )
        return [
            MultiModalItem(
                "image", {"pixel_values": enc["pixel_values"][0]}, span[0], len(span), image_keys[0]
            )
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        pixels = torch.stack([it.data["pixel_values"] for it in items])
        states = self.vision_model(pixels, [-1])[0]
        states = F.normalize(self.vision_model.post_layernorm(states), dim=-1)
        return list(self.image_to_text_projection(states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = bool(
            getattr(self.text_config, "tie_word_embeddings", False)
            or getattr(self.config, "tie_word_embeddings", False)
        )
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("position_ids", "embed_positions.weights") + (("lm_head.",) if tied else ()),
        )


@register_text_shape("kosmos_2_text_model")
def kosmos2_text_shape(text: dict) -> TextShape:
    """Its own key names; OPT-like (a two-matrix gelu MLP, biases, LayerNorms) plus two sub-LayerNorms per layer."""
    heads, hidden = int(text["attention_heads"]), int(text["embed_dim"])
    return TextShape(
        hidden=hidden,
        layers=int(text["layers"]),
        heads=heads,
        head_dim=int(text.get("head_dim") or hidden // heads),
        vocab=int(text["vocab_size"]),
        intermediate=int(text["ffn_dim"]),
        kv_heads=heads,
        mlp_matrices=2,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        layer_norm=True,
        sub_layer_norm=True,
    )
