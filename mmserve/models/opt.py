"""OPT decoder backbone (learned positions, LayerNorm, ReLU MLP, biased attention) over the paged cache."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.distributed import get_tp_size
from mmserve.layers.activation import get_act_fn
from mmserve.layers.attention import Attention
from mmserve.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mmserve.models.family import TextShape, basic_sizes
from mmserve.models.registry import register_text_shape

PACKED_MODULES = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
}

# checkpoint prefix -> our module path: OPTForCausalLM as transformers saves it, then the metaseq-era layout
WEIGHT_RENAMES = [("model.decoder.", "model."), ("decoder.", "model.")]

# OPT's position table is offset by 2 (a fairseq padding convention): token at position p reads row p + 2
POSITION_OFFSET = 2


def _layer_norm(config) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, elementwise_affine=config.layer_norm_elementwise_affine)


class OPTAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        tp = get_tp_size()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        if self.head_dim * heads != config.hidden_size:
            raise ValueError(f"hidden_size {config.hidden_size} is not a multiple of {heads} heads")
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, heads, bias=config.enable_bias
        )
        self.out_proj = RowParallelLinear(
            config.hidden_size, config.hidden_size, bias=config.enable_bias
        )
        self.q_size = heads // tp * self.head_dim
        self.scaling = self.head_dim**-0.5
        # queries are scaled before the dot product (as in transformers), so the kernel scale is 1
        self.attn = Attention(heads // tp, self.head_dim, heads // tp, 1.0)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size] * 3, dim=-1)
        return self.out_proj(self.attn(q * self.scaling, k, v, meta))


class OPTDecoderLayer(nn.Module):
    """Pre-LN (`do_layer_norm_before`, most sizes) or post-LN (opt-350m) residual block."""

    def __init__(self, config) -> None:
        super().__init__()
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config)
        self.self_attn_layer_norm = _layer_norm(config)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias=config.enable_bias)
        self.act = get_act_fn(config.activation_function)
        self.final_layer_norm = _layer_norm(config)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, embed_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(config.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden
        )
        # opt-350m embeds words in a smaller space and projects in and out of the hidden size
        self.project_in = (
            ReplicatedLinear(embed_dim, hidden, bias=False) if embed_dim != hidden else None
        )
        self.project_out = (
            ReplicatedLinear(hidden, embed_dim, bias=False) if embed_dim != hidden else None
        )
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        keep_final = config.do_layer_norm_before and not getattr(
            config, "_remove_final_layer_norm", False
        )
        self.final_layer_norm = _layer_norm(config) if keep_final else None
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # inputs_embeds [T, word_embed_proj_dim], positions [T] (0-based) -> [T, word_embed_proj_dim]
        x = self.project_in(inputs_embeds) if self.project_in is not None else inputs_embeds
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            x = layer(x, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return self.project_out(x) if self.project_out is not None else x


class OPTForCausalLM(nn.Module):
    """Decoder + LM head (tied to the word embeddings unless the config says otherwise)."""

    packed_modules = PACKED_MODULES
    weight_renames = WEIGHT_RENAMES

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = OPTDecoder(config)
        self.lm_head = ReplicatedLinear(config.word_embed_proj_dim, config.vocab_size, bias=False)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(inputs_embeds, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@register_text_shape("opt")
def opt_text_shape(text: dict) -> TextShape:
    """Biases on every linear, a two-matrix ReLU MLP, LayerNorms, optionally a narrower word embedding."""
    sizes = basic_sizes(text)
    bias = bool(text.get("enable_bias", True))
    return TextShape(
        **sizes,
        intermediate=int(text["ffn_dim"]),
        kv_heads=sizes["heads"],
        mlp_matrices=2,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        layer_norm=True,
        final_norm=bool(text.get("do_layer_norm_before", True))
        and not text.get("_remove_final_layer_norm", False),
        embed_dim=int(text.get("word_embed_proj_dim") or sizes["hidden"]),
    )
