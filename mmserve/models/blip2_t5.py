"""BLIP-2 with Flan-T5 (HF `Blip2ForConditionalGeneration` whose text model is T5, e.g. blip2-flan-t5-xl): the
query tokens and the question go through the T5 encoder once per request; the decoder writes the answer from its
start token, attending the encoder states through every layer's cross-attention (the encoder-decoder path of
`nougat.py`). The encoder's input holds the text, so the item's identity is the picture and the text together.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mmserve.core.multimodal import MultiModalItem
from mmserve.models.base import CrossKVLayout, EncoderDecoderLM, check_single_image
from mmserve.models.blip2 import BLIP2_PROMPT, Blip2ForConditionalGeneration, _used
from mmserve.models.family import FamilySpec
from mmserve.models.registry import register_family
from mmserve.models.t5 import T5LanguageModel
from mmserve.models.weights import load_weights


@register_family(
    FamilySpec(
        name="blip2_t5",
        architectures=("Blip2ForConditionalGeneration",),
        config_matches=lambda cfg: getattr(cfg.text_config, "model_type", "") == "t5",
        prompt=BLIP2_PROMPT,
        attention="encoder_decoder",
        placeholder_in_prompt=False,
        encoder_reads_text=True,  # the processor's ids (query tokens + question) are the encoder's input
        cross_decode_graphs=True,
    )
)
class Blip2T5ForConditionalGeneration(Blip2ForConditionalGeneration, EncoderDecoderLM):
    @staticmethod
    def _language_model(text) -> nn.Module:
        return T5LanguageModel(text)

    @classmethod
    def decoder_prompt_ids(cls, hf_config, tokenizer: Any, text: str) -> list[int]:
        """The decoder starts from its start token alone: the question is the encoder's."""
        return [hf_config.text_config.decoder_start_token_id]

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        check_single_image(image_keys, video_keys, required=True)
        encoder_ids = enc["encoder_input_ids"][0].long()
        n = hf_config.num_query_tokens
        if int((encoder_ids == hf_config.image_token_index).sum()) != n:
            raise ValueError(f"the encoder input needs {n} image tokens")
        key = f"{image_keys[0]}:{hashlib.sha256(encoder_ids.numpy().tobytes()).hexdigest()[:32]}"
        return [
            MultiModalItem(
                "image",
                {"pixel_values": enc["pixel_values"][0], "input_ids": encoder_ids},
                0,
                1,
                key,
                kv_from=0,
            )
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Per request: the T5 encoder's states of [query tokens with the picture's embeddings; the question],
        [tokens, d_model]."""
        queries = self.query_embeddings(torch.stack([it.data["pixel_values"] for it in items]))
        lm = self.language_model
        out = []
        for item, q in zip(items, queries):
            ids = item.data["input_ids"].to(q.device)
            embeds = lm.embed_input_ids(ids)
            embeds[ids == self.config.image_token_index] = q.to(embeds.dtype)
            out.append(lm.encoder(embeds))
        return out

    def cross_kv(self, encoded: torch.Tensor) -> torch.Tensor:
        """Every decoder layer's cross keys/values (this rank's heads), [tokens, layers, 2, heads, d_kv]."""
        return self.language_model.cross_kv(encoded)

    def drop_encoders(self) -> None:
        """A tensor-parallel worker also frees the T5 encoder: the driver runs it and sends its states."""
        super().drop_encoders()
        self.language_model.encoder = None

    def cross_kv_layout(self) -> CrossKVLayout:
        return self.language_model.cross_kv_layout()

    def cross_kv_tokens(self, item: MultiModalItem) -> int:
        """The encoder's input: query tokens + question."""
        return len(item.data["input_ids"])

    def lora_target_ok(self, module_name: str) -> bool:
        # the encoder runs per request and the cross k/v once per request: their rows are not the step's
        return ".encoder." not in module_name and ".EncDecAttention." not in module_name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen: set[str] = set()

        def tracked():
            for name, tensor in _used(weights):
                seen.add(name)
                yield name, tensor

        load_weights(
            self, tracked(), self.weight_renames, {}, ignore=("position_ids", "embed_tokens.weight")
        )
        self.language_model.share_head_if_absent(seen)
