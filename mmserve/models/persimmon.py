"""Persimmon decoder backbone (Fuyu's language model): LayerNorms with biases, a fused per-head q/k/v projection,
LayerNorm on each head's queries and keys, rotary on the first part of each head, a squared-ReLU MLP. The LM head
around it is `llama.LlamaForCausalLM(config, backbone=PersimmonModel(config))`."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.distributed import get_tp_size
from mmserve.layers.activation import get_act_fn
from mmserve.layers.attention import Attention
from mmserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from mmserve.layers.rotary import PartialRotaryEmbedding, rope_inv_freq
from mmserve.models.family import TextShape, basic_sizes
from mmserve.models.registry import register_text_shape


class PersimmonAttention(nn.Module):
    def __init__(self, config, rotary: PartialRotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.num_heads = config.num_attention_heads // get_tp_size()  # this rank's heads
        # the checkpoint's rows are [head 0: q, k, v; head 1: q, k, v; ...], which a column split keeps per head
        self.query_key_value = ColumnParallelLinear(hidden, 3 * hidden, bias=True)
        self.dense = RowParallelLinear(hidden, hidden, bias=True)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.head_dim, self.num_heads, self.head_dim**-0.5)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t = len(x)
        q, k, v = self.query_key_value(x).view(t, -1, 3, self.head_dim).unbind(2)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rotary(positions, q, k)
        return self.dense(self.attn(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), meta))


class PersimmonMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, bias=True
        )
        self.dense_4h_to_h = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=True
        )
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class PersimmonDecoderLayer(nn.Module):
    def __init__(self, config, rotary: PartialRotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = PersimmonAttention(config, rotary)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = PersimmonMLP(config)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class PersimmonModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        head_dim = config.hidden_size // config.num_attention_heads
        factor = (getattr(config, "rope_parameters", None) or {}).get(
            "partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)
        )
        rotary_dim = int(head_dim * factor)
        inv_freq, _ = rope_inv_freq(config, rotary_dim)
        rotary = PartialRotaryEmbedding(
            inv_freq, config.max_position_embeddings, rotary_dim
        )  # one for all layers
        self.layers = nn.ModuleList(
            PersimmonDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)
        )
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, positions, meta)
        return self.final_layernorm(x)


@register_text_shape("persimmon", "fuyu")  # "fuyu": adept/fuyu-8b's flat config.json
def persimmon_text_shape(text: dict) -> TextShape:
    """OPT-like (biases everywhere, LayerNorms, a two-matrix relu2 MLP) plus q and k LayerNorms over head_dim."""
    sizes = basic_sizes(text)
    return TextShape(
        **sizes,
        intermediate=int(text["intermediate_size"]),
        kv_heads=sizes["heads"],
        mlp_matrices=2,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        layer_norm=True,
        qk_norm=bool(text.get("qk_layernorm", True)),
    )
