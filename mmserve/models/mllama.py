"""Llama 3.2 Vision (HF `MllamaForConditionalGeneration`): a tiled ViT whose projected states the text model
attends through gated cross-attention layers placed between its Llama self-attention layers.

Unlike the placeholder families, an image occupies one `<|image|>` token of the prompt, embedded as a normal
token. What the encoder yields per image (`get_mm_embeddings`) is its tiles' states at the text width, whose
keys and values of every cross-attention layer (`cross_kv`: [tokens, cross layers, 2, kv heads, head_dim]; under
tensor parallelism each rank projects its own heads from the same states) the runner writes to the
request's blocks of the cross-attention pool (`cross_kv_order`: the real tiles its generated tokens attend
first) and hands each step's sequences with images to the text model in `AttentionMetadata.cross`.

Which images a text position attends follows the HF processor's `cross_attention_mask`: image i from its own
`<|image|>` token up to the next image's token (a run of adjacent image tokens up to the end of the run's
last span), the last image to the end, generated tokens like the prompt's last token; only an image's real
tiles. A position that attends no image (text before the first image) attends every tile of every image
uniformly, as transformers does, and its cross-layer MLP output is dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata, CrossAttentionBatch
from mmserve.core.multimodal import MultiModalItem
from mmserve.distributed import get_tp_size
from mmserve.layers.cross_attention import attend_cross
from mmserve.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mmserve.layers.norm import RMSNorm
from mmserve.layers.rotary import RotaryEmbedding, rope_inv_freq
from mmserve.models.base import CrossAttentionLM, CrossKVLayout
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from mmserve.models.mllama_vision import MllamaVisionTower
from mmserve.models.registry import register_family
from mmserve.models.weights import load_weights

# checkpoint prefix -> our module path: transformers >= 5 save_pretrained layout; the hub layout is ours already
WEIGHT_RENAMES = [
    ("model.vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
]


def image_spans(offsets: list[int], prompt_len: int) -> list[tuple[int, int]]:
    """[start, end) of the prompt positions attending each image (HF `get_cross_attention_token_mask`);
    end == prompt_len means to the end, generated tokens included."""
    spans = [[a, b] for a, b in zip(offsets, offsets[1:] + [prompt_len])]
    last_end = prompt_len
    for span in reversed(
        spans
    ):  # adjacent image tokens attend together up to the end of the run's last span
        if span[0] == span[1] - 1:
            span[1] = last_end
        last_end = span[1]
    return [(a, b) for a, b in spans]


class _StepCross:
    """The step's sequences with images (`batch`): the masks of those that are not decodes (pool order) and which
    rows keep their cross-layer MLP output, built once for all cross layers. A decode attends the images its
    prompt's last position does, the first tokens of its pool blocks (`cross_kv_order`), so it needs no mask."""

    def __init__(
        self, batch: CrossAttentionBatch, num_rows: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.batch = batch
        rows = [s.rows for s in batch.seqs]
        self.all_rows = (
            rows[0].start == 0
            and rows[-1].stop == num_rows
            and all(a.stop == b.start for a, b in zip(rows, rows[1:]))
        )
        self.index = (
            None
            if self.all_rows
            else torch.cat([torch.arange(r.start, r.stop, device=device) for r in rows])
        )
        d = batch.num_decodes
        built = [self._seq(s, dtype, device) for s in batch.seqs[d:]]
        self.masks = [mask for mask, _ in built]
        keeps = [keep for _, keep in built]
        self.keep = None  # [rows, 1]: 0 for rows attending no image (their MLP output is dropped), None: all kept
        if any(k is not None for k in keeps):
            self.keep = torch.cat(
                [torch.ones(d, 1, dtype=dtype, device=device)]
                + [
                    k
                    if k is not None
                    else torch.ones(s.rows.stop - s.rows.start, 1, dtype=dtype, device=device)
                    for k, s in zip(keeps, batch.seqs[d:])
                ]
            )

    @staticmethod
    def _seq(
        s, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mask [rows, tokens] bool in pool order: which image tokens each row attends, keep [rows, 1] or None)."""
        n = s.rows.stop - s.rows.start
        mask = torch.zeros(n, s.num_tokens, dtype=torch.bool, device=device)
        keep = torch.zeros(n, 1, dtype=dtype, device=device)
        last = s.prompt_len - 1  # generated positions attend what the prompt's last one does
        per_tile = s.num_tokens // sum(it.data["pixel_values"].shape[0] for it in s.items)
        col = 0
        any_rows = []
        for item, (lo, hi) in zip(
            s.items, image_spans([it.offset for it in s.items], s.prompt_len)
        ):
            real = int(item.data["num_tiles"])
            # rows whose clamped position p satisfies lo <= p < hi; positions past the prompt count as `last`
            first = max(lo - s.start, 0)
            stop = n if hi > last else min(max(hi - s.start, 0), n)
            if first < stop:
                mask[first:stop, col : col + real * per_tile] = True
                keep[first:stop] = 1
                any_rows.append((first, stop))
            col += item.data["pixel_values"].shape[0] * per_tile
        covered = _union_len(any_rows)
        if (
            covered < n
        ):  # rows attending no image attend all image tokens alike (transformers' masked-out rows)
            mask[keep[:, 0] == 0] = True
        return (mask if s.order is None else mask[:, s.order]), (None if covered == n else keep)


def _union_len(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, 0
    for a, b in sorted(intervals):
        a = max(a, end)
        if b > a:
            total += b - a
            end = b
    return total


class MllamaCrossAttention(nn.Module):
    def __init__(self, config, slot: int) -> None:
        super().__init__()
        self.slot = slot  # this layer's index among the cross layers (in the encoder's kv tensor)
        tp = get_tp_size()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // heads
        self.num_heads, self.num_kv_heads = (
            heads // tp,
            kv_heads // tp,
        )  # this tensor-parallel rank's
        hidden = config.hidden_size
        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_kv(self, states: torch.Tensor) -> torch.Tensor:
        """[T, hidden] image states -> [T, 2, kv heads, head_dim] keys (normalised) and values."""
        t = len(states)
        k = self.k_norm(self.k_proj(states).reshape(-1, self.head_dim)).view(
            t, self.num_kv_heads, self.head_dim
        )
        v = self.v_proj(states).view(t, self.num_kv_heads, self.head_dim)
        return torch.stack([k, v], dim=1)

    def forward(self, x: torch.Tensor, cross: _StepCross) -> torch.Tensor:
        n = len(x)
        q = self.q_norm(self.q_proj(x).reshape(-1, self.head_dim)).view(
            n, self.num_heads, self.head_dim
        )
        return self.o_proj(
            attend_cross(q, cross.batch, self.slot, self.head_dim**-0.5, cross.masks).view(n, -1)
        )


class MllamaCrossAttentionDecoderLayer(nn.Module):
    """Cross-attention and MLP, each added through a tanh gate; no self-attention, no KV cache of its own."""

    def __init__(self, config, slot: int) -> None:
        super().__init__()
        self.cross_attn = MllamaCrossAttention(config, slot)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, h: torch.Tensor, cross: _StepCross) -> torch.Tensor:
        x = h if cross.all_rows else h[cross.index]
        x = x + self.cross_attn_attn_gate.tanh() * self.cross_attn(self.input_layernorm(x), cross)
        m = self.mlp(self.post_attention_layernorm(x))
        if cross.keep is not None:
            m = m * cross.keep
        x = x + self.cross_attn_mlp_gate.tanh() * m
        return x if cross.all_rows else h.index_copy(0, cross.index, x)


class MllamaTextModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size + 8, config.hidden_size
        )  # + image token rows
        self.embed_tokens.weight.requires_grad_(False)
        cross = list(config.cross_attention_layers)
        # one rotary table for all layers: at Llama 3's 131072 positions a table per layer would take 4 GB
        inv_freq, scaling = rope_inv_freq(config, config.hidden_size // config.num_attention_heads)
        rotary = RotaryEmbedding(inv_freq, config.max_position_embeddings, scaling)
        self.layers = nn.ModuleList(
            MllamaCrossAttentionDecoderLayer(config, cross.index(i))
            if i in cross
            else LlamaDecoderLayer(config, qkv_bias=False, rotary=rotary)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def cross_layers(self) -> list[MllamaCrossAttentionDecoderLayer]:
        return [m for m in self.layers if isinstance(m, MllamaCrossAttentionDecoderLayer)]

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        cross = None
        if meta.cross is not None and meta.cross.seqs:
            cross = _StepCross(
                meta.cross, len(inputs_embeds), inputs_embeds.dtype, inputs_embeds.device
            )
        x, residual = inputs_embeds, None
        for layer in self.layers:
            if isinstance(layer, MllamaCrossAttentionDecoderLayer):
                if (
                    cross is not None
                ):  # sequences without images skip these layers (as transformers does)
                    x, residual = layer(x if residual is None else x + residual, cross), None
            else:
                x, residual = layer(x, residual, positions, meta)
        if residual is None:
            return self.norm(x)
        return self.norm(x, residual)[0]


@register_family(
    FamilySpec(
        name="mllama",
        architectures=("MllamaForConditionalGeneration",),
        model_types=("mllama",),
        prompt=PromptFormat("<|image|>", prepend_images=True),
        client=ClientFormat("mllama"),
        attention="cross",
        cross_decode_graphs=True,
        images_per_prompt_lists=True,
    )
)
class MllamaForConditionalGeneration(CrossAttentionLM):
    """One `<|image|>` token per image; the image's tiles reach the text through the cross-attention layers."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = config.text_config
        if getattr(self.text_config, "tie_word_embeddings", False) or getattr(
            config, "tie_word_embeddings", False
        ):
            raise ValueError("Mllama checkpoints with tied word embeddings are not supported")
        self.vision_model = MllamaVisionTower(config.vision_config)
        self.multi_modal_projector = ReplicatedLinear(
            config.vision_config.vision_output_dim, self.text_config.hidden_size, bias=True
        )
        self.language_model = LlamaForCausalLM(
            self.text_config, backbone=MllamaTextModel(self.text_config)
        )

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """Each image's `<|image|>` token and its tiles: pixel_values [max tiles, 3, H, W], aspect ratio id and
        mask, the number of real tiles. Its keys/values are hashed into the prompt's first block (kv_from 0):
        the text before the image attends it too."""
        if video_keys:
            raise ValueError("Mllama does not take video input")
        token = hf_config.image_token_index
        offsets = [i for i, t in enumerate(ids) if t == token]
        if len(offsets) != len(image_keys):
            raise ValueError(
                f"the prompt has {len(offsets)} image tokens but {len(image_keys)} images were given"
            )
        num_tiles = enc["num_tiles"][0] if "num_tiles" in enc else None
        items = []
        for k, off in enumerate(offsets):
            pixels = enc["pixel_values"][0, k]
            real = (
                num_tiles[k] if num_tiles is not None else int(enc["aspect_ratio_mask"][0, k].sum())
            )
            data = {
                "pixel_values": pixels,
                "aspect_ratio_ids": torch.as_tensor(enc["aspect_ratio_ids"][0, k]).long(),
                "aspect_ratio_mask": torch.as_tensor(enc["aspect_ratio_mask"][0, k]).long(),
                "num_tiles": torch.tensor(int(real)),
            }
            items.append(MultiModalItem("image", data, off, 1, image_keys[k], kv_from=0))
        return items

    def lora_target_ok(self, module_name: str) -> bool:
        layer = (
            module_name.split(".layers.", 1)[1].split(".", 1)[0]
            if ".layers." in module_name
            else None
        )
        return layer is None or int(layer) not in self.text_config.cross_attention_layers

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Per image: its tiles' states projected to the text model's width, [tiles * patches, hidden] (padding
        tiles included: rows attending no image see them); `cross_kv` makes them keys/values."""
        dev = self.multi_modal_projector.weight.device
        pixels = torch.stack([it.data["pixel_values"] for it in items])
        ratio_ids = torch.stack([it.data["aspect_ratio_ids"] for it in items]).to(dev)
        ratio_mask = torch.stack([it.data["aspect_ratio_mask"] for it in items]).to(dev)
        states = self.vision_model(pixels, ratio_ids, ratio_mask)  # [N, tiles, patches, vdim]
        return list(
            self.multi_modal_projector(states.flatten(1, 2))
        )  # [tiles * patches, hidden] each

    def cross_kv(self, encoded: torch.Tensor) -> torch.Tensor:
        """Image states [T, hidden] -> the keys/values of every cross layer, [T, cross layers, 2, kv heads,
        head_dim] (this tensor-parallel rank's heads)."""
        return torch.stack(
            [
                layer.cross_attn.project_kv(encoded)
                for layer in self.language_model.model.cross_layers
            ],
            dim=1,
        )

    @staticmethod
    def cross_item_layout(item: MultiModalItem) -> MultiModalItem:
        """The item as the text model's cross-attention reads it (offset, tile counts), without its pixels: what a
        tensor-parallel worker gets with each step."""
        data = {
            "pixel_values": torch.empty(item.data["pixel_values"].shape[0], 0),
            "num_tiles": torch.as_tensor(item.data["num_tiles"]),
        }
        return dataclasses.replace(item, data=data)

    def cross_kv_layout(self) -> CrossKVLayout:
        layers = self.language_model.model.cross_layers
        a = layers[0].cross_attn
        return CrossKVLayout(len(layers), a.num_kv_heads, a.head_dim)

    def cross_kv_tokens(self, item: MultiModalItem) -> int:
        """Every tile (padding tiles too) of every patch."""
        return item.data["pixel_values"].shape[0] * self.vision_model.num_patches

    def cross_kv_order(
        self, items: list[MultiModalItem], prompt_len: int
    ) -> tuple[torch.Tensor | None, int]:
        """The real tiles of the images the prompt's last position attends (and so its generated tokens) first,
        then the rest (padding tiles, earlier images: only prompt rows attend those)."""
        first, rest, col = [], [], 0
        for item, (_, hi) in zip(items, image_spans([it.offset for it in items], prompt_len)):
            n = self.cross_kv_tokens(item)
            real = int(item.data["num_tiles"]) * self.vision_model.num_patches
            (first if hi >= prompt_len else rest).append(torch.arange(col, col + real))
            rest.append(torch.arange(col + real, col + n))
            col += n
        order = torch.cat(first + rest)
        decode_len = sum(len(c) for c in first)
        return (None if torch.equal(order, torch.arange(col)) else order), decode_len

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("rotary_emb.inv_freq", "position_ids"),
        )
