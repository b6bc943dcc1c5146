"""The published on-disk layout of CogVLM / CogVLM2 checkpoints: config.json, generation_config.json and every
tensor name and shape, as :mod:`mmserve.testing.cogvlm` writes them.

Names and shapes follow the original remote code (``modeling_cogvlm.py``: ``VisionExpertAttention``,
``VisionExpertMLP``, ``CogVLMDecoderLayer``, ``CogVLMModel``; ``visual.py``: ``PatchEmbedding``, ``Attention``,
``MLP``, ``TransformerLayer``, ``GLU``, ``EVA2CLIPModel``) and cogvlm2-llama3-chat-19B's
``model.safetensors.index.json`` (which also lists each layer's ``self_attn.rotary_emb.inv_freq`` buffer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from mmserve.testing.cogvlm import CogVLMSizes

# the rotary base each version's modeling_cogvlm.py hard-codes (FastRotaryEmbedding's default / base=500000)
ROPE_BASE = {1: 10000.0, 2: 500000.0}
AUTO_MAP = {
    "AutoConfig": "configuration_cogvlm.CogVLMConfig",
    "AutoModelForCausalLM": "modeling_cogvlm.CogVLMForCausalLM",
}
GLU_LAYER_NORM_EPS = 1e-5  # visual.py GLU.norm1 = nn.LayerNorm(hidden_size): torch's default eps
# (name, shape, kind): kind is one of recipe.layer_kind's, or "inv_freq" (the rotary buffer's true values)
Spec = tuple[str, tuple[int, ...], str]


def inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """util.py ``FastRotaryEmbedding._compute_inv_freq``: 1 / base ** (arange(0, head_dim, 2) / head_dim), float32."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def vision_grid(s: CogVLMSizes) -> int:
    """Patches per side of the EVA2-CLIP tower's input."""
    return s.image_size // s.patch_size


def config_dict(s: CogVLMSizes, ids: dict[str, Any]) -> dict[str, Any]:
    """config.json as published: the remote CogVLMConfig's fields (v2 adds ``num_multi_query_heads``, which the
    published v2 file leaves to the class default 8; written here so the tiny GQA is expressible) and the EVA
    ``vision_config`` dict as ``visual.py`` reads it (``Namespace(**config.vision_config)``)."""
    eos = ids["eos"][0] if len(ids["eos"]) == 1 else list(ids["eos"])
    out: dict[str, Any] = {
        "architectures": ["CogVLMForCausalLM"],
        "auto_map": dict(AUTO_MAP),
        "bos_token_id": ids["bos"],
        "eos_token_id": eos,
        "pad_token_id": ids["pad"],
        "hidden_act": "silu",
        "hidden_size": s.text_hidden,
        "initializer_range": s.text_init_std,
        "intermediate_size": s.text_intermediate,
        "max_position_embeddings": s.max_position,
        "num_attention_heads": s.text_heads,
        "num_hidden_layers": s.text_layers,
        "rms_norm_eps": s.rms_norm_eps,
        "template_version": "chat",
        "tie_word_embeddings": False,
        "torch_dtype": s.dtype,
        "use_cache": True,
        "vision_config": {
            "dropout_prob": 0.0,
            "hidden_act": "gelu",
            "hidden_size": s.vision_hidden,
            "image_size": s.image_size,
            "in_channels": 3,
            "intermediate_size": s.vision_intermediate,
            "layer_norm_eps": s.vision_layer_norm_eps,
            "num_heads": s.vision_heads,
            "num_hidden_layers": s.vision_layers,
            "num_positions": vision_grid(s) ** 2 + 1,
            "patch_size": s.patch_size,
        },
        "vocab_size": s.vocab_size,
    }
    if s.version == 2:
        out["num_multi_query_heads"] = s.text_kv_heads
    return out


def generation_dict(s: CogVLMSizes, ids: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the special ids (every EOS id); v2 adds the published sampling defaults."""
    eos = ids["eos"][0] if len(ids["eos"]) == 1 else list(ids["eos"])
    out: dict[str, Any] = {
        "_from_model_config": True,
        "bos_token_id": ids["bos"],
        "eos_token_id": eos,
        "pad_token_id": ids["pad"],
    }
    if s.version == 2:
        out.update(do_sample=True, temperature=0.6, max_length=4096, top_p=0.9)
    return out


def qkv_rows(s: CogVLMSizes) -> int:
    """Output rows of a fused expert qkv: hidden + 2 * kv_heads * head_dim (v1: 3 * hidden)."""
    return s.text_hidden + 2 * s.text_kv_heads * (s.text_hidden // s.text_heads)


def _text_specs(s: CogVLMSizes) -> list[Spec]:
    h, i, half = s.text_hidden, s.text_intermediate, s.text_hidden // s.text_heads // 2
    specs: list[Spec] = [
        ("model.embed_tokens.weight", (s.vocab_size, h), "matrix"),
        ("model.norm.weight", (h,), "noisy_norm_weight"),
        ("lm_head.weight", (s.vocab_size, h), "matrix"),
    ]
    for n in range(s.text_layers):
        p = f"model.layers.{n}."
        specs += [
            (p + "input_layernorm.weight", (h,), "noisy_norm_weight"),
            (p + "post_attention_layernorm.weight", (h,), "noisy_norm_weight"),
            (p + "self_attn.rotary_emb.inv_freq", (half,), "inv_freq"),
        ]
        for expert in ("language", "vision"):
            specs += [
                (
                    p + f"self_attn.{expert}_expert_query_key_value.weight",
                    (qkv_rows(s), h),
                    "matrix",
                ),
                (p + f"self_attn.{expert}_expert_dense.weight", (h, h), "matrix"),
                (p + f"mlp.{expert}_mlp.gate_proj.weight", (i, h), "matrix"),
                (p + f"mlp.{expert}_mlp.up_proj.weight", (i, h), "matrix"),
                (p + f"mlp.{expert}_mlp.down_proj.weight", (h, i), "matrix"),
            ]
        if s.version == 2:  # VisionExpertAttention: vision qkv bias=True, language qkv bias=False
            specs.append(
                (p + "self_attn.vision_expert_query_key_value.bias", (qkv_rows(s),), "bias")
            )
    return specs


def _vision_specs(s: CogVLMSizes) -> list[Spec]:
    vh, vi, h, i = s.vision_hidden, s.vision_intermediate, s.text_hidden, s.text_intermediate
    v = "model.vision."
    specs: list[Spec] = [
        (v + "patch_embedding.proj.weight", (vh, 3, s.patch_size, s.patch_size), "matrix"),
        (v + "patch_embedding.proj.bias", (vh,), "bias"),
        (v + "patch_embedding.cls_embedding", (1, vh), "matrix"),
        (v + "patch_embedding.position_embedding.weight", (vision_grid(s) ** 2 + 1, vh), "matrix"),
        (v + "linear_proj.linear_proj.weight", (h, vh), "matrix"),
        (v + "linear_proj.norm1.weight", (h,), "noisy_norm_weight"),
        (v + "linear_proj.norm1.bias", (h,), "norm_bias"),
        (v + "linear_proj.gate_proj.weight", (i, h), "matrix"),
        (v + "linear_proj.dense_h_to_4h.weight", (i, h), "matrix"),
        (v + "linear_proj.dense_4h_to_h.weight", (h, i), "matrix"),
        (v + "boi", (1, 1, h), "matrix"),
        (v + "eoi", (1, 1, h), "matrix"),
    ]
    if s.version == 2:  # EVA2CLIPModel.conv: vision hidden -> vision hidden, 2x2 stride 2
        specs += [(v + "conv.weight", (vh, vh, 2, 2), "matrix"), (v + "conv.bias", (vh,), "bias")]
    for n in range(s.vision_layers):
        p = f"{v}transformer.layers.{n}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs += [
                (p + f"{norm}.weight", (vh,), "noisy_norm_weight"),
                (p + f"{norm}.bias", (vh,), "norm_bias"),
            ]
        for name, shape in (
            ("attention.query_key_value", (3 * vh, vh)),
            ("attention.dense", (vh, vh)),
            ("mlp.fc1", (vi, vh)),
            ("mlp.fc2", (vh, vi)),
        ):
            specs += [
                (p + f"{name}.weight", shape, "matrix"),
                (p + f"{name}.bias", shape[:1], "bias"),
            ]
    return specs


def param_specs(s: CogVLMSizes) -> list[Spec]:
    """(name, shape, kind) of every tensor on disk, named as published."""
    return _text_specs(s) + _vision_specs(s)
