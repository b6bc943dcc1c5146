"""Llama-style decoder backbone (Llama, Mistral, Qwen2: RMSNorm, RoPE, GQA, SwiGLU) over the paged cache."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.distributed import get_tp_size
from mmserve.layers.activation import SiluAndMul
from mmserve.layers.attention import Attention
from mmserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import RotaryEmbedding, rope_inv_freq
from mmserve.models.family import TextShape, basic_sizes
from mmserve.models.registry import register_text_shape

PACKED_MODULES = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config, qkv_bias: bool, rotary: nn.Module | None = None) -> None:
        super().__init__()
        tp = get_tp_size()
        self.head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, kv_heads, qkv_bias
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=bool(getattr(config, "attention_bias", False)),
        )
        self.q_size = config.num_attention_heads // tp * self.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        if rotary is None:
            inv_freq, scaling = rope_inv_freq(config, self.head_dim)
            rotary = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        self.rotary = rotary
        self.attn = Attention(
            config.num_attention_heads // tp,
            self.head_dim,
            self.qkv_proj.num_kv_heads,
            self.head_dim**-0.5,
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, meta, self.rotary, positions))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fp8_activation_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(producer, linear) pairs whose producer can hand its output to an FP8 linear already quantized."""
        return [
            (self.input_layernorm, self.self_attn.qkv_proj),
            (self.post_attention_layernorm, self.mlp.gate_up_proj),
            (self.mlp.act, self.mlp.down_proj),
        ]

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool = False, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # inputs_embeds [T, hidden], positions [T] -> [T, hidden]
        x, residual = inputs_embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """Backbone + LM head. `qkv_bias` is True for Qwen2-style checkpoints. `rotary`, when given, is one
    module shared by all layers, called as rotary(positions, q, k) (e.g. Qwen2-VL's M-RoPE); default:
    1D RoPE from the config. `backbone` replaces the LlamaModel (Mllama's text model with cross layers)."""

    packed_modules = PACKED_MODULES

    def __init__(
        self,
        config,
        qkv_bias: bool | None = None,
        rotary: nn.Module | None = None,
        backbone: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if qkv_bias is None:
            qkv_bias = (
                bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
            )
        self.config = config
        self.model = backbone if backbone is not None else LlamaModel(config, qkv_bias, rotary)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(inputs_embeds, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


@register_text_shape("*")
def llama_text_shape(text: dict) -> TextShape:
    """Llama-style decoders (Llama, Mistral, Qwen2 with q/k/v biases, Mllama with cross-attention layers)."""
    sizes = basic_sizes(text)
    attention_bias = bool(text.get("attention_bias", False))
    return TextShape(
        **sizes,
        intermediate=int(text["intermediate_size"]),
        # CogVLM2's config.json names its kv heads num_multi_query_heads
        kv_heads=int(
            text.get("num_key_value_heads") or text.get("num_multi_query_heads") or sizes["heads"]
        ),
        qkv_bias=attention_bias or "qwen2" in str(text.get("model_type", "")),
        o_bias=attention_bias,
        mlp_bias=bool(text.get("mlp_bias", False)),
        cross_layers=len(text.get("cross_attention_layers") or ()),
    )
