"""CogVLM (`THUDM/cogvlm-chat-hf`) and CogVLM2 (`THUDM/cogvlm2-llama3-chat-19B`): an EVA2-CLIP tower and a Llama with
a visual expert in every layer (models/eva2_clip.py, models/cogvlm_decoder.py), read from the published checkpoints
without their remote code.

The prompt is THUDM's `build_conversation_input_ids`: `[bos] + one row per picture feature (boi, patches, eoi) +
the text` (at most one picture, right after BOS), its rows' ids the tokenizer's pad. Positions
(`build_position_ids`): boi and eoi count as text, every patch shares one position: bos 0, boi 1, patches 2, eoi 3,
text 4, ...; decoding continues from there. The visual expert takes a picture's rows but its last (eoi), as
`get_expert_mask` has it. Both versions name `CogVLMForCausalLM`; v2 has `num_multi_query_heads` (GQA), a bias on
the visual expert's q/k/v, a 2×2 convolution after the tower and Llama 3's vocabulary. Their rotary bases are
hard-coded in the original (10000, 500000); positions here are exact integers (v2's original rounds them to
bfloat16 past 256 when run in bfloat16). CogVLM ships no tokenizer (its users take lmsys/vicuna-7b-v1.5's): it is
read from a `tokenizer/` sub-folder when there is one, else from the checkpoint itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.models.base import MultiModalCausalLM, check_single_image
from mmserve.models.cogvlm_decoder import PACKED_MODULES, CogVLMModel
from mmserve.models.eva2_clip import EVA2CLIPModel
from mmserve.models.family import FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.registry import register_family
from mmserve.models.split_prompt import SquarePictures
from mmserve.models.weights import load_weights

LLAMA3_VOCAB = (
    128256  # v2's published config.json leaves out num_multi_query_heads (its default: 8)
)
ROPE_BASE = {1: 10000.0, 2: 500000.0}
# _history_to_prompt with template "chat": past turns "Question: {q} Answer: {a}\n", then "Question: {q} Answer:"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set text = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -%}"
    "{%- if message['role'] == 'user' -%}{{- 'Question: ' + text + ' Answer:' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- ' ' + text + '\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
)


def cogvlm_version(fields: dict[str, Any]) -> int:
    if fields.get("num_multi_query_heads") is not None or fields.get("vocab_size") == LLAMA3_VOCAB:
        return 2
    return 1


class CogVLMProcessor:
    """Text (+ one picture) → `input_ids` [1, P], `pixel_values` [1, 3, S, S] and `image_spans`; called as an HF
    processor."""

    def __init__(self, tokenizer: Any, image_size: int, rows: int) -> None:
        self.tokenizer, self.rows = tokenizer, rows
        self.image_processor = SquarePictures(image_size)
        self.chat_template = CHAT_TEMPLATE

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, **kwargs)

    def __call__(
        self, text: str, images: list | None = None, return_tensors: str = "pt", **kw: Any
    ) -> dict[str, Any]:
        tok = self.tokenizer
        n = self.rows if images else 0
        ids = (
            [tok.bos_token_id] + [tok.pad_token_id] * n + tok.encode(text, add_special_tokens=False)
        )
        out: dict[str, Any] = {
            "input_ids": torch.tensor([ids]),
            "image_spans": [(1, n)] if n else [],
        }
        if images:
            out["pixel_values"] = self.image_processor(images)["pixel_values"]
        return out


@register_family(
    FamilySpec(
        name="cogvlm",
        architectures=("CogVLMForCausalLM",),
        model_types=("cogvlm", "cogvlm2"),
        prompt=PromptFormat(None),  # the text as sent; the picture goes right after BOS
        placeholder_in_prompt=False,
        own_positions=True,
        media_rows="span_but_last",
        encoder_cuda_graphs=True,
    )
)
class CogVLMForCausalLM(MultiModalCausalLM):
    """CogVLM / CogVLM2: one picture → boi + its projected features + eoi over its pad rows."""

    weight_renames = [
        ("model.vision.", "vision."),
        ("model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
    ]

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        text = config.text_config
        self.vision = EVA2CLIPModel(
            config.vision_config, text.hidden_size, text.intermediate_size, config.version == 2
        )
        self.language_model = LlamaForCausalLM(text, backbone=CogVLMModel(text))
        self.language_model.packed_modules = PACKED_MODULES

    @classmethod
    def load_config(cls, model_dir: str) -> Any:
        from transformers import LlamaConfig, PretrainedConfig

        fields = json.loads((Path(model_dir) / "config.json").read_text())
        version = cogvlm_version(fields)
        heads = fields["num_attention_heads"]
        kv_heads = heads if version == 1 else fields.get("num_multi_query_heads") or 8
        dtype = fields.get("torch_dtype") or fields.get("dtype") or "bfloat16"
        text = LlamaConfig(
            vocab_size=fields["vocab_size"],
            hidden_size=fields["hidden_size"],
            intermediate_size=fields["intermediate_size"],
            num_hidden_layers=fields["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=fields.get("max_position_embeddings", 2048),
            rms_norm_eps=fields.get("rms_norm_eps", 1e-5),
            bos_token_id=fields.get("bos_token_id"),
            eos_token_id=fields.get("eos_token_id"),
            pad_token_id=fields.get("pad_token_id"),
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_BASE[version]},
            tie_word_embeddings=False,
        )
        text.vision_qkv_bias = version == 2
        text.dtype = dtype
        vision = PretrainedConfig(**fields["vision_config"])
        config = PretrainedConfig(architectures=fields["architectures"], version=version)
        config.text_config, config.vision_config, config.dtype = text, vision, dtype
        return config

    @classmethod
    def build_processor(cls, model_dir: str, hf_config: Any) -> CogVLMProcessor:
        from transformers import AutoTokenizer

        sub = Path(model_dir) / "tokenizer"
        where = sub if (sub / "tokenizer_config.json").is_file() else Path(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False)
        return CogVLMProcessor(tokenizer, hf_config.vision_config.image_size, image_rows(hf_config))

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        check_single_image(image_keys, video_keys, required=False)
        return [
            MultiModalItem("image", {"pixel_values": enc["pixel_values"][k]}, off, n, image_keys[k])
            for k, (off, n) in enumerate(enc["image_spans"])
        ]

    @classmethod
    def prompt_positions(cls, hf_config, enc, ids: list[int]) -> tuple[torch.Tensor | None, int]:
        """`build_position_ids`: a picture's patches share the position after boi's; eoi and the text go on."""
        spans = enc["image_spans"] if enc is not None else []
        if not spans:
            return None, 0
        ((offset, n),) = spans
        pos = torch.arange(len(ids), dtype=torch.int64)
        pos[offset + 1 : offset + n - 1] = offset + 1
        pos[offset + n - 1 :] -= n - 3
        return pos[None], -(n - 3)

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        return list(self.vision(torch.stack([it.data["pixel_values"] for it in items])))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(
            self,
            self._split_qkv(weights),
            self.weight_renames,
            PACKED_MODULES,
            ignore=("rotary_emb.inv_freq",),
        )

    def _split_qkv(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        """The experts' fused q/k/v ([q; k; v] rows) as parts `…_query_key_value.{q,k,v}.` for our fused layers."""
        text = self.config.text_config
        hd = text.hidden_size // text.num_attention_heads
        sizes = [
            text.num_attention_heads * hd,
            text.num_key_value_heads * hd,
            text.num_key_value_heads * hd,
        ]
        for name, tensor in weights:
            if "_expert_query_key_value." in name:
                for part, piece in zip("qkv", tensor.split(sizes, dim=0)):
                    yield name.replace("_query_key_value.", f"_query_key_value.{part}."), piece
            else:
                yield name, tensor


def image_rows(config: Any) -> int:
    """A picture's rows: boi + patches (the grid; CogVLM2's halved per side) + eoi."""
    v = config.vision_config
    grid = v.image_size // v.patch_size
    return (grid // 2 if config.version == 2 else grid) ** 2 + 2
