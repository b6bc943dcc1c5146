"""NeMo's Megatron-core GPT decoder (NeVA's language model), configured by its `model_config.yaml`: LayerNorm,
LayerNorm1P (a scale stored minus one) or RMSNorm; squared-ReLU, GELU or SwiGLU; rotary over `rotary_percentage`
of each head; grouped queries (`num_query_groups`); optional biases; shared input / output embeddings.

Checkpoint layout (Megatron-core names): `linear_qkv` rows per query group are the group's queries, its key, its
value (split here into our fused q/k/v), the input norms fused into `linear_qkv` / `linear_fc1` as
`layer_norm_weight` / `_bias`, a gated `linear_fc1` is [gate; up]. The LM head around it is
`llama.LlamaForCausalLM(config, backbone=NemoGPTModel(config))`.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.distributed import get_tp_size
from mmserve.layers.activation import SiluAndMul, get_act_fn
from mmserve.layers.attention import Attention
from mmserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import PartialRotaryEmbedding, RotaryEmbedding, rope_inv_freq
from mmserve.models.family import TextShape, basic_sizes
from mmserve.models.registry import register_text_shape

GATED = ("swiglu", "fast-swiglu")
ACTIVATIONS = {"squared-relu": "relu2", "gelu": "gelu", "relu": "relu"}
NORMS = ("layernorm", "layernorm1p", "rmsnorm")


def make_norm(config) -> nn.Module:
    if config.normalization == "rmsnorm":
        return RMSNorm(config.hidden_size, config.layernorm_epsilon)
    return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)


class NemoAttention(nn.Module):
    def __init__(self, config, rotary: nn.Module) -> None:
        super().__init__()
        tp = get_tp_size()
        heads, groups, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.head_dim = hd
        self.layer_norm = make_norm(config)
        self.linear_qkv = QKVParallelLinear(config.hidden_size, hd, heads, groups, config.bias)
        self.linear_proj = RowParallelLinear(heads * hd, config.hidden_size, bias=config.bias)
        self.q_size = heads // tp * hd
        self.kv_size = self.linear_qkv.num_kv_heads * hd
        self.rotary = rotary
        self.attn = Attention(heads // tp, hd, self.linear_qkv.num_kv_heads, hd**-0.5)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.linear_qkv(self.layer_norm(x)).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        if isinstance(
            self.rotary, PartialRotaryEmbedding
        ):  # in torch: the fused kernels rotate whole heads
            t = len(x)
            q, k = self.rotary(
                positions, q.view(t, -1, self.head_dim), k.view(t, -1, self.head_dim)
            )
            out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta)
        else:
            out = self.attn(q, k, v, meta, self.rotary, positions)
        return self.linear_proj(out)


class NemoMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer_norm = make_norm(config)
        h, ffn = config.hidden_size, config.intermediate_size
        if config.activation in GATED:
            self.linear_fc1 = MergedColumnParallelLinear(h, [ffn, ffn], bias=config.bias)
            self.act = SiluAndMul()
        else:
            self.linear_fc1 = ColumnParallelLinear(h, ffn, bias=config.bias)
            self.act = get_act_fn(ACTIVATIONS[config.activation])
        self.linear_fc2 = RowParallelLinear(ffn, h, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(self.layer_norm(x))))


class NemoLayer(nn.Module):
    def __init__(self, config, rotary: nn.Module) -> None:
        super().__init__()
        self.self_attention = NemoAttention(config, rotary)
        self.mlp = NemoMLP(config)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attention(x, positions, meta)
        return x + self.mlp(x)


class NemoGPTModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.normalization not in NORMS:
            raise ValueError(
                f"NeMo normalization {config.normalization!r} is not supported: {NORMS}"
            )
        if config.activation not in (*GATED, *ACTIVATIONS):
            supported = (*GATED, *ACTIVATIONS)
            raise ValueError(f"NeMo activation {config.activation!r} is not supported: {supported}")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        rotary_dim = int(config.head_dim * config.rotary_percentage)
        inv_freq, scaling = rope_inv_freq(config, rotary_dim)
        if rotary_dim == config.head_dim:
            rotary = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        else:
            rotary = PartialRotaryEmbedding(inv_freq, config.max_position_embeddings, rotary_dim)
        self.layers = nn.ModuleList(
            NemoLayer(config, rotary) for _ in range(config.num_hidden_layers)
        )
        self.final_layernorm = make_norm(config)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, positions, meta)
        return self.final_layernorm(x)


@register_text_shape("nemo_gpt")
def nemo_gpt_text_shape(text: dict) -> TextShape:
    """Grouped queries, LayerNorm (1P) with shifts or RMSNorm, two matrices (three for SwiGLU), optional biases."""
    bias = bool(text["bias"])
    return TextShape(
        **basic_sizes(text),
        intermediate=int(text["intermediate_size"]),
        kv_heads=int(text["num_key_value_heads"]),
        mlp_matrices=3 if text["activation"] in GATED else 2,
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bias,
        layer_norm=text["normalization"] != "rmsnorm",
    )
