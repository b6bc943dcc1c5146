"""MBart decoder (HF `MBartForCausalLM` with cross-attention: Nougat's text decoder) over the paged cache.

Pre-LN blocks of self-attention, cross-attention over the sequence's encoder keys/values (kept with the request,
`AttentionMetadata.cross`) and a two-matrix MLP; scaled token embeddings plus learned positions (offset 2), a
LayerNorm on the embeddings and one after the last block. The LM head around it is
`llama.LlamaForCausalLM(config, backbone=MBartDecoder(config))`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.distributed import get_tp_size
from mmserve.layers.activation import get_act_fn
from mmserve.layers.attention import Attention
from mmserve.layers.cross_attention import attend_cross
from mmserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from mmserve.models.family import TextShape
from mmserve.models.registry import register_text_shape

POSITION_OFFSET = 2  # MBart's learned positions start at row 2


class MBartSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, heads = config.d_model, config.decoder_attention_heads
        self.head_dim = d // heads
        self.qkv_proj = QKVParallelLinear(d, self.head_dim, heads, heads, bias=True)
        self.out_proj = RowParallelLinear(d, d, bias=True)
        local = heads // get_tp_size()
        self.attn = Attention(local, self.head_dim, local, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, meta))


class MBartCrossAttention(nn.Module):
    """Queries from the text, keys/values from the encoder states (projected once per image by `project_kv`);
    `num_heads`: this tensor-parallel rank's."""

    def __init__(self, config, slot: int) -> None:
        super().__init__()
        d, heads = config.d_model, config.decoder_attention_heads
        self.num_heads, self.head_dim, self.slot = heads // get_tp_size(), d // heads, slot
        self.q_proj = ColumnParallelLinear(d, d, bias=True)
        self.k_proj = ColumnParallelLinear(d, d, bias=True)
        self.v_proj = ColumnParallelLinear(d, d, bias=True)
        self.out_proj = RowParallelLinear(d, d, bias=True)

    def project_kv(self, states: torch.Tensor) -> torch.Tensor:
        """[T, d_model] encoder states -> [T, 2, heads, head_dim]."""
        t = len(states)
        return torch.stack(
            [
                self.k_proj(states).view(t, self.num_heads, self.head_dim),
                self.v_proj(states).view(t, self.num_heads, self.head_dim),
            ],
            dim=1,
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = len(x)
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        return self.out_proj(
            attend_cross(q, meta.cross, self.slot, self.head_dim**-0.5).view(n, -1)
        )


class MBartDecoderLayer(nn.Module):
    def __init__(self, config, slot: int) -> None:
        super().__init__()
        d = config.d_model
        self.self_attn = MBartSelfAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = MBartCrossAttention(config, slot)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = ColumnParallelLinear(d, config.decoder_ffn_dim, bias=True)
        self.fc2 = RowParallelLinear(config.decoder_ffn_dim, d, bias=True)
        self.act = get_act_fn(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), meta)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), meta)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class MBartDecoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(
            config.max_position_embeddings + POSITION_OFFSET, config.d_model
        )
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layers = nn.ModuleList(
            MBartDecoderLayer(config, i) for i in range(config.decoder_layers)
        )
        self.layer_norm = nn.LayerNorm(config.d_model)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if meta.cross is None or sum(s.rows.stop - s.rows.start for s in meta.cross.seqs) != len(
            inputs_embeds
        ):
            raise ValueError("every sequence of an encoder-decoder model needs its encoder states")
        x = inputs_embeds * self.embed_scale + self.embed_positions(positions + POSITION_OFFSET)
        x = self.layernorm_embedding(x)
        for layer in self.layers:
            x = layer(x, meta)
        return self.layer_norm(x)


@register_text_shape("mbart")
def mbart_text_shape(text: dict) -> TextShape:
    """The decoder_* sizes (num_hidden_layers etc. alias the encoder's); OPT-like with a gelu MLP, an embedding
    LayerNorm and a cross-attention in every layer."""
    heads, hidden = int(text["decoder_attention_heads"]), int(text["d_model"])
    return TextShape(
        hidden=hidden,
        layers=int(text["decoder_layers"]),
        heads=heads,
        head_dim=hidden // heads,
        vocab=int(text["vocab_size"]),
        intermediate=int(text["decoder_ffn_dim"]),
        kv_heads=heads,
        mlp_matrices=2,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        layer_norm=True,
        embed_norm=True,
        cross_attention=bool(text.get("add_cross_attention", False)),
    )
