"""Qwen2-VL / Qwen2.5-VL family: ViT tower with patch merger (qwen2_vl_vision) + Qwen2 backbone with M-RoPE.

Images and videos become variable-length runs of `<|image_pad|>` / `<|video_pad|>` tokens (one per
merged 2x2 patch block). M-RoPE gives every prompt token a (t, h, w) position: text advances all three
together, vision tokens take their grid coordinates; decode token p sits at p + delta on all axes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.rotary import MRotaryEmbedding, rope_inv_freq
from mmserve.models.base import MultiModalCausalLM
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.qwen2_vl_vision import Qwen2VisionTransformer
from mmserve.models.registry import register_family
from mmserve.models.weights import load_weights
from mmserve.multimodal.placeholder_expansion import placeholder_runs

# checkpoint prefix -> our module path; HF >= 5 layout first, then the published Qwen2-VL layout
WEIGHT_RENAMES = [
    ("model.visual.", "visual."),
    ("model.language_model.", "language_model.model."),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
]

TEXT, IMAGE, VIDEO = 0, 1, 2
# modality -> (HF processor output with its patches, output with one (t, h, w) row per item)
MM_KEYS = {
    "image": ("pixel_values", "image_grid_thw"),
    "video": ("pixel_values_videos", "video_grid_thw"),
}
GRID_KEYS = {IMAGE: "image_grid_thw", VIDEO: "video_grid_thw"}


@register_family(
    FamilySpec(
        name="qwen2_vl",
        architectures=("Qwen2VLForConditionalGeneration",),
        model_types=("qwen2_vl",),
        prompt=PromptFormat(
            "<|vision_start|><|image_pad|><|vision_end|>",
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
            "<|im_end|>\n<|im_start|>assistant\n",
            video_token="<|vision_start|><|video_pad|><|vision_end|>",
        ),
        client=ClientFormat("qwen2_vl", resize=(504, 504)),
        mrope=True,
    )
)
class Qwen2VLForConditionalGeneration(MultiModalCausalLM):
    """One image or video -> t*h*w / merge² embeddings that replace its pad tokens."""

    weight_renames = (
        WEIGHT_RENAMES  # checkpoint prefix -> ours (LoRA adapters resolve their targets too)
    )

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.text_config = tc = config.text_config
        if getattr(tc, "use_sliding_window", False):
            raise ValueError("Qwen2-VL checkpoints with use_sliding_window=True are not supported")
        self.merge = config.vision_config.spatial_merge_size
        self.visual = Qwen2VisionTransformer(config.vision_config)
        head_dim = tc.hidden_size // tc.num_attention_heads
        inv_freq, scaling = rope_inv_freq(tc, head_dim)
        rotary = MRotaryEmbedding(
            inv_freq, tc.max_position_embeddings, tc.rope_parameters["mrope_section"], scaling
        )
        self.language_model = LlamaForCausalLM(tc, qkv_bias=True, rotary=rotary)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied:
            self.language_model.lm_head.weight = self.language_model.model.embed_tokens.weight

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """Each image's / video's pad-token run and its encoder inputs: its rows of the processor's
        patches [n, C * T * P * P] and its grid_thw [3]."""
        merge2 = hf_config.vision_config.spatial_merge_size**2
        items = []
        for modality, keys, token_id in (
            ("image", image_keys, hf_config.image_token_id),
            ("video", video_keys, hf_config.video_token_id),
        ):
            if not keys:
                continue
            pix_key, grid_key = MM_KEYS[modality]
            grids = enc[grid_key]  # [n, 3]
            patches = grids.prod(-1).tolist()
            lengths = [p // merge2 for p in patches]
            offsets = placeholder_runs(ids, token_id, lengths)
            starts = [0, *itertools.accumulate(patches)]
            for k, key in enumerate(keys):
                data = {
                    "pixel_values": enc[pix_key][starts[k] : starts[k + 1]],
                    "grid_thw": grids[k],
                }
                items.append(MultiModalItem(modality, data, offsets[k], lengths[k], key))
        return items  # ProcessedInputs puts them in prompt order

    @classmethod
    def prompt_positions(cls, hf_config, enc, ids: list[int]) -> tuple[torch.Tensor, int]:
        """The prompt's (t, h, w) positions [3, P] and the decode offset delta, as transformers' get_rope_index:
        a vision run starting at position s takes (s + t, s + h, s + w) over its merged grid, and the text
        after it continues at s + max(h, w) (merged units). `enc` None (text only): positions p, delta 0.

        transformers 5.23 advances by max(h, w) even when a video has more temporal patches (older versions
        and vLLM take max(t, h, w)); we follow the oracle we are tested against.
        """
        merge = hf_config.vision_config.spatial_merge_size
        grids = {
            kind: iter(enc[key].tolist())
            for kind, key in GRID_KEYS.items()
            if enc is not None and key in enc
        }
        token_kind = {hf_config.image_token_id: IMAGE, hf_config.video_token_id: VIDEO}
        kinds = [token_kind[t] if token_kind.get(t) in grids else TEXT for t in ids]
        parts, cur, k_video = [], 0, 0
        for kind, run in itertools.groupby(kinds):
            n = len(list(run))
            if kind == TEXT:
                parts.append(torch.arange(cur, cur + n).expand(3, -1))
                cur += n
                continue
            t, h, w = next(grids[kind])
            h, w = h // merge, w // merge
            interval = cls.temporal_interval(hf_config, enc, k_video) if kind == VIDEO else 1
            k_video += kind == VIDEO
            tt = (torch.arange(t) * interval).long().view(-1, 1, 1).expand(t, h, w)
            hh = torch.arange(h).view(1, -1, 1).expand(t, h, w)
            ww = torch.arange(w).view(1, 1, -1).expand(t, h, w)
            pos = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
            if pos.shape[1] != n:
                raise ValueError(
                    f"a run of {n} vision placeholder tokens does not match its grid {t}x{h}x{w}"
                )
            parts.append(pos)
            cur += max(h, w)
        positions = torch.cat(parts, dim=1)
        return positions, int(positions.max()) + 1 - len(ids)

    @classmethod
    def temporal_interval(cls, hf_config, enc, k: int) -> float | torch.Tensor:
        """Temporal position step between the temporal patches of the k-th video (Qwen2-VL: 1)."""
        return 1

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode images / videos in one packed sequence. Returns one [length, text_hidden] tensor per item."""
        grids = [it.data["grid_thw"].tolist() for it in items]
        for item, (t, h, w) in zip(items, grids):
            if t * h * w // self.merge**2 != item.length:
                raise ValueError(
                    f"{item.modality} gives {t * h * w // self.merge**2} embeddings but the prompt "
                    f"has {item.length} placeholders"
                )
        feats = self.visual(torch.cat([it.data["pixel_values"] for it in items]), grids)
        return list(feats.split([it.length for it in items]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=("rotary_emb.inv_freq", "position_ids") + (("lm_head.",) if self.tied else ()),
        )


@register_family(
    FamilySpec(name="qwen2_5_vl", architectures=("Qwen2_5_VLForConditionalGeneration",), mrope=True)
)
class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: the same backbone and M-RoPE; the tower windows its attention (qwen2_vl_vision), and a
    video's temporal positions step by tokens_per_second * seconds per temporal patch."""

    @classmethod
    def temporal_interval(cls, hf_config, enc, k: int) -> float | torch.Tensor:
        per_second = hf_config.vision_config.tokens_per_second
        seconds = enc.get("second_per_grid_ts") if enc is not None else None
        # a float32 0-d tensor like transformers', so truncating t * interval to int agrees to the bit
        return per_second if seconds is None else per_second * torch.as_tensor(seconds)[k]
