"""CogVLM's decoder: a Llama whose attention q/k/v, attention output and MLP exist twice per layer, the visual
expert for picture rows and the language expert for the rest (THUDM's `modeling_cogvlm.py`: `VisionExpertAttention`,
`VisionExpertMLP`, `CogVLMDecoderLayer`; the rows: `get_expert_mask`). Norms, embeddings and the head are shared.

Which rows are a picture's comes from the step (`AttentionMetadata.media_rows` / `text_rows`, built by the runner from
each request's spans under the spec's "span_but_last" rule); a step without them (decode, text, CUDA graphs) runs
the language expert alone.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.distributed import get_tp_size
from mmserve.layers.attention import Attention
from mmserve.layers.linear import QKVParallelLinear, RowParallelLinear
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import RotaryEmbedding, rope_inv_freq
from mmserve.models.llama import LlamaMLP

EXPERTS = ("language", "vision")
# the checkpoint's fused expert q/k/v, split by CogVLM.checkpoint_weights into parts our fused layer loads
PACKED_MODULES = {
    "_query_key_value.q.": ("_query_key_value.", "q"),
    "_query_key_value.k.": ("_query_key_value.", "k"),
    "_query_key_value.v.": ("_query_key_value.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def by_expert(x: torch.Tensor, meta: AttentionMetadata, language: nn.Module, vision: nn.Module):
    """`language` on text rows and `vision` on picture rows of `x` [T, in] → [T, out]."""
    rows = meta.media_rows
    if rows is None:
        return language(x)
    out_vis = vision(x[rows])
    out = out_vis.new_empty(x.shape[0], out_vis.shape[1])
    out[rows] = out_vis
    if meta.text_rows.numel():
        out[meta.text_rows] = language(x[meta.text_rows])
    return out


class VisionExpertAttention(nn.Module):
    def __init__(self, config, rotary: nn.Module) -> None:
        super().__init__()
        tp = get_tp_size()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // heads
        for expert, bias in zip(EXPERTS, (False, config.vision_qkv_bias)):
            qkv = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias)
            setattr(self, f"{expert}_expert_query_key_value", qkv)
            dense = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=False)
            setattr(self, f"{expert}_expert_dense", dense)
        self.q_size = heads // tp * self.head_dim
        self.kv_size = self.language_expert_query_key_value.num_kv_heads * self.head_dim
        self.rotary = rotary
        self.attn = Attention(
            heads // tp,
            self.head_dim,
            self.language_expert_query_key_value.num_kv_heads,
            self.head_dim**-0.5,
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = by_expert(
            x, meta, self.language_expert_query_key_value, self.vision_expert_query_key_value
        )
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v, meta, self.rotary, positions)
        return by_expert(out, meta, self.language_expert_dense, self.vision_expert_dense)


class VisionExpertMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.language_mlp = LlamaMLP(config)
        self.vision_mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return by_expert(x, meta, self.language_mlp, self.vision_mlp)


class CogVLMDecoderLayer(nn.Module):
    def __init__(self, config, rotary: nn.Module) -> None:
        super().__init__()
        self.self_attn = VisionExpertAttention(config, rotary)
        self.mlp = VisionExpertMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        return self.mlp(x, meta), residual


class CogVLMModel(nn.Module):
    """The decoder stack (a LlamaForCausalLM backbone): embeddings, expert layers, final norm."""

    def __init__(self, config) -> None:
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        inv_freq, scaling = rope_inv_freq(config, head_dim)
        rotary = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            CogVLMDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x, residual = inputs_embeds, None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        x, _ = self.norm(x, residual)
        return x
