"""BLIP-2 family: ViT vision tower + Q-Former (learned queries cross-attending to the image) + projection
+ OPT backbone (HF `Salesforce/blip2-opt-*` checkpoints). One image becomes `num_query_tokens` embeddings."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.activation import get_act_fn
from mmserve.layers.cross_attention import attend_batched
from mmserve.layers.linear import ReplicatedLinear
from mmserve.models.base import MultiModalCausalLM, check_single_image
from mmserve.models.clip import CLIPEncoderLayer
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.opt import OPTForCausalLM
from mmserve.models.registry import register_family
from mmserve.models.weights import load_weights
from mmserve.multimodal.placeholder_expansion import placeholder_runs

# Our module names follow the checkpoint's, except the OPT decoder, which sits one level higher.
# transformers 5 `save_pretrained` and the published Salesforce repos share these prefixes.
WEIGHT_RENAMES = [("language_model.model.decoder.", "language_model.model.")]

# In the Salesforce repos (converted with transformers 4.2x) each Q-Former layer also carries the
# feed-forward of the text branch, which image-conditioned generation never runs.
_UNUSED = re.compile(r"^qformer\.(embeddings\.|encoder\.layer\.\d+\.(intermediate|output)\.)")


# ---- vision tower ---------------------------------------------------------------------------
class Blip2VisionEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, p = config.hidden_size, config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(1, 1, h), requires_grad=False)
        self.patch_embedding = nn.Conv2d(3, h, p, p)
        num_positions = (config.image_size // p) ** 2 + 1
        self.position_embedding = nn.Parameter(
            torch.empty(1, num_positions, h), requires_grad=False
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values [N, 3, H, W] -> [N, 1 + patches, hidden]
        patches = (
            self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
            .flatten(2)
            .transpose(1, 2)
        )
        x = torch.cat([self.class_embedding.expand(len(patches), 1, -1), patches], dim=1)
        if x.shape[1] != self.position_embedding.shape[1]:
            raise ValueError(
                f"image gives {x.shape[1] - 1} patches but the vision tower has positions for "
                f"{self.position_embedding.shape[1] - 1}"
            )
        return x + self.position_embedding


class Blip2VisionAttention(nn.Module):
    """Fused qkv; the checkpoint's qkv.bias is [q_bias, 0, v_bias] (the ViT has no key bias)."""

    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qkv = ReplicatedLinear(h, 3 * h, bias=config.qkv_bias)
        self.projection = ReplicatedLinear(h, h, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.projection(attend_batched(q, k, v, self.num_heads))


class _Stack(nn.Module):
    """Holds a ModuleList under the attribute name the checkpoint uses (`layers` or `layer`)."""

    def __init__(self, name: str, layers: list[nn.Module]) -> None:
        super().__init__()
        setattr(self, name, nn.ModuleList(layers))


class Blip2VisionModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embeddings = Blip2VisionEmbeddings(config)
        self.encoder = _Stack(
            "layers",
            [
                CLIPEncoderLayer(config, Blip2VisionAttention)
                for _ in range(config.num_hidden_layers)
            ],
        )
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> last hidden state after the post-LayerNorm, [N, 1 + patches, hidden]."""
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# ---- Q-Former ---------------------------------------------------------------------------------
class _DenseNorm(nn.Module):
    """BERT output block: LayerNorm(dense(x) + residual)."""

    def __init__(self, in_features: int, config) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(in_features, config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _QKV(nn.Module):
    def __init__(self, config, kv_features: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = ReplicatedLinear(h, h, bias=True)
        self.key = ReplicatedLinear(kv_features, h, bias=True)
        self.value = ReplicatedLinear(kv_features, h, bias=True)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return attend_batched(self.query(x), self.key(kv), self.value(kv), self.num_heads)


class Blip2QFormerAttention(nn.Module):
    """Self-attention (kv_features = hidden) or cross-attention to the image (kv_features = vision hidden)."""

    def __init__(self, config, kv_features: int) -> None:
        super().__init__()
        self.attention = _QKV(config, kv_features)
        self.output = _DenseNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return self.output(self.attention(x, kv), x)


class _Intermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Blip2QFormerLayer(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.attention = Blip2QFormerAttention(config, config.hidden_size)
        if index % config.cross_attention_frequency == 0:
            self.crossattention = Blip2QFormerAttention(config, config.encoder_hidden_size)
        else:
            self.crossattention = None
        self.intermediate_query = _Intermediate(config)
        self.output_query = _DenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, x)
        if self.crossattention is not None:
            x = self.crossattention(x, image)
        return self.output_query(self.intermediate_query(x), x)


class Blip2QFormerModel(nn.Module):
    """Only the query branch: the queries attend to each other and, every `cross_attention_frequency`
    layers, to the image features."""

    def __init__(self, config) -> None:
        super().__init__()
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = _Stack(
            "layer", [Blip2QFormerLayer(config, i) for i in range(config.num_hidden_layers)]
        )

    def forward(self, queries: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        # queries [N, Q, qformer_hidden], image [N, S, vision_hidden] -> [N, Q, qformer_hidden]
        x = self.layernorm(queries)
        for layer in self.encoder.layer:
            x = layer(x, image)
        return x


# ---- the family -------------------------------------------------------------------------------
BLIP2_PROMPT = PromptFormat(image_token=None)


@register_family(
    FamilySpec(
        name="blip2",
        architectures=("Blip2ForConditionalGeneration",),
        model_types=("blip2", "blip-2"),
        prompt=BLIP2_PROMPT,
        client=ClientFormat("blip2", preprocessed=True),
        placeholder_in_prompt=False,  # the HF processor inserts the image tokens itself
        encoder_cuda_graphs=True,
    )
)
class Blip2ForConditionalGeneration(MultiModalCausalLM):
    """One image -> `num_query_tokens` embeddings that replace the image tokens the processor put in
    front of the prompt. The Q-Former and query tokens stay in fp32 whatever the model dtype, as in
    transformers (`_keep_in_fp32_modules`)."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text = self.text_config = config.text_config
        qcfg = config.qformer_config
        self.vision_model = Blip2VisionModel(config.vision_config)
        self.query_tokens = nn.Parameter(
            torch.empty(1, config.num_query_tokens, qcfg.hidden_size, dtype=torch.float32),
            requires_grad=False,
        )
        self.qformer = Blip2QFormerModel(qcfg).float()
        self.language_projection = ReplicatedLinear(qcfg.hidden_size, text.hidden_size, bias=True)
        self.language_model = self._language_model(text)
        for p in self.parameters():
            p.requires_grad_(False)

    @staticmethod
    def _language_model(text) -> nn.Module:
        if text.model_type != "opt":
            raise ValueError(
                f"BLIP-2 with a {text.model_type!r} language model is not supported (OPT, T5)"
            )
        if text.word_embed_proj_dim != text.hidden_size:
            raise ValueError(
                "BLIP-2 needs OPT's word_embed_proj_dim == hidden_size (the projection writes "
                "hidden_size-wide image embeddings into the word-embedding stream)"
            )
        return OPTForCausalLM(text)

    def query_embeddings(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] images -> [N, num_query_tokens, text_hidden]: vision tower, Q-Former, projection."""
        image = self.vision_model(pixels)  # [N, S, vision_hidden]
        queries = self.query_tokens.expand(len(pixels), -1, -1)
        out = self.qformer(queries, image.to(queries.dtype)).to(
            image.dtype
        )  # [N, Q, qformer_hidden]
        return self.language_projection(out)

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """The single image's run of `num_query_tokens` image tokens and its pixel_values [3, H, W]."""
        check_single_image(image_keys, video_keys, required=False)
        if not image_keys:
            return []
        n = hf_config.num_query_tokens
        (offset,) = placeholder_runs(ids, hf_config.image_token_index, [n])
        return [
            MultiModalItem(
                "image", {"pixel_values": enc["pixel_values"][0]}, offset, n, image_keys[0]
            )
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode images in one batch. Returns one [num_query_tokens, text_hidden] tensor per item."""
        feats = list(self.query_embeddings(torch.stack([it.data["pixel_values"] for it in items])))
        for item, emb in zip(items, feats):
            if len(emb) != item.length:
                raise ValueError(
                    f"image gives {len(emb)} embeddings but the prompt has {item.length} image tokens"
                )
        return feats

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        ignore = ("position_ids",) + (
            ("language_model.lm_head.",) if self.language_model.tied else ()
        )
        load_weights(
            self, _used(weights), self.weight_renames, OPTForCausalLM.packed_modules, ignore=ignore
        )


def _used(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, t) for name, t in weights if not _UNUSED.match(name))
