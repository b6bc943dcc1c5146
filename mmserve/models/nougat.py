"""Nougat (HF `VisionEncoderDecoderModel` with a Donut Swin encoder and an MBart decoder): the picture of a page is
encoded once; the decoder writes its markdown from the decoder start token, attending the encoder states through
every layer's cross-attention.

The encoder-decoder shape maps onto the engine's cross-attention path (as Mllama's): the request's prompt is the
decoder's (the start token, then any text the client gives as the answer's beginning); its one item is the
picture at the start token (`kv_from` 0: every block depends on it), and what the encoder yields per picture is
the keys and values of every decoder layer's cross-attention over its states.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.layers.linear import ReplicatedLinear
from mmserve.models.base import CrossKVLayout, EncoderDecoderLM, check_single_image
from mmserve.models.donut_swin import DonutSwinTower
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.llama import LlamaForCausalLM
from mmserve.models.mbart import MBartDecoder
from mmserve.models.registry import register_family
from mmserve.models.weights import load_weights

WEIGHT_RENAMES = [
    ("decoder.model.decoder.", "language_model.model."),
    ("decoder.lm_head.", "language_model.lm_head."),
]


@register_family(
    FamilySpec(
        name="nougat",
        architectures=("VisionEncoderDecoderModel",),
        model_types=("vision-encoder-decoder", "nougat"),
        prompt=PromptFormat(image_token=None),  # the text (often empty) starts the answer
        client=ClientFormat("nougat"),
        attention="encoder_decoder",
        placeholder_in_prompt=False,
        cross_decode_graphs=True,
    )
)
class NougatForConditionalGeneration(EncoderDecoderLM):
    """Donut Swin encoder + MBart decoder with cross-attention (the pairing Nougat checkpoints use)."""

    weight_renames = WEIGHT_RENAMES

    def __init__(self, config) -> None:
        super().__init__()
        enc, dec = config.encoder, config.decoder
        if enc.model_type != "donut-swin" or dec.model_type != "mbart":
            raise ValueError(
                f"VisionEncoderDecoderModel with a {enc.model_type!r} encoder and a {dec.model_type!r} "
                "decoder is not supported (Nougat's donut-swin + mbart is)"
            )
        self.config = config
        self.text_config = dec
        self.encoder = DonutSwinTower(enc)
        enc_hidden = enc.hidden_size
        self.enc_to_dec_proj = None
        if enc_hidden != dec.d_model and getattr(dec, "cross_attention_hidden_size", None) is None:
            self.enc_to_dec_proj = ReplicatedLinear(enc_hidden, dec.d_model, bias=True)
        self.language_model = LlamaForCausalLM(dec, backbone=MBartDecoder(dec))

    @classmethod
    def decoder_prompt_ids(cls, hf_config, tokenizer: Any, text: str) -> list[int]:
        """The decoder's prompt: its start token, then the client's text (tokenized without special tokens)."""
        start = hf_config.decoder_start_token_id
        if start is None:
            start = hf_config.decoder.decoder_start_token_id or hf_config.decoder.bos_token_id
        return [start] + (tokenizer(text, add_special_tokens=False).input_ids if text else [])

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        check_single_image(image_keys, video_keys, required=True)
        return [
            MultiModalItem(
                "image", {"pixel_values": enc["pixel_values"][0]}, 0, 1, image_keys[0], kv_from=0
            )
        ]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Per picture: the encoder's states in the decoder's width, [tokens, d_model]."""
        states = self.encoder(torch.stack([it.data["pixel_values"] for it in items]))
        if self.enc_to_dec_proj is not None:
            states = self.enc_to_dec_proj(states)
        return list(states)

    def cross_kv(self, encoded: torch.Tensor) -> torch.Tensor:
        """Every decoder layer's cross-attention keys/values (this rank's heads), [tokens, layers, 2, heads,
        head_dim]."""
        layers = self.language_model.model.layers
        return torch.stack([layer.encoder_attn.project_kv(encoded) for layer in layers], dim=1)

    def cross_kv_layout(self) -> CrossKVLayout:
        layers = self.language_model.model.layers
        a = layers[0].encoder_attn
        return CrossKVLayout(len(layers), a.num_heads, a.head_dim)

    def cross_kv_tokens(self, item: MultiModalItem) -> int:
        """The Swin's last map: ceil(H / patch), halved with ceil at each later stage."""
        config = self.encoder.config
        ph, pw = self.encoder.embeddings.patch_embeddings.patch_size
        h, w = (-(-n // p) for n, p in zip(item.data["pixel_values"].shape[-2:], (ph, pw)))
        for _ in range(len(config.depths) - 1):
            h, w = -(-h // 2), -(-w // 2)
        return h * w

    def lora_target_ok(self, module_name: str) -> bool:
        return (
            ".encoder_attn." not in module_name
        )  # its k/v run on the encoder states, once per picture

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tied = bool(getattr(self.text_config, "tie_word_embeddings", False))
        load_weights(
            self,
            weights,
            self.weight_renames,
            LlamaForCausalLM.packed_modules,
            ignore=(".relative_position_index",) + (("decoder.lm_head.",) if tied else ()),
        )
