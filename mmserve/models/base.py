"""The interfaces a family class offers: :class:`MultiModalCausalLM`, and for families whose text attends the
encoder through cross-attention :class:`CrossAttentionLM`, for encoder-decoders :class:`EncoderDecoderLM`.

A family class wraps a vision encoder and a language model (``self.language_model``) and carries its declared
:class:`~mmserve.models.family.FamilySpec` as ``family``. Two parts of the server use it:

* the loader (on the class): ``load_config`` reads the checkpoint's config (default ``AutoConfig``) and
  ``checkpoint_weights`` lists its (name, tensor) pairs (default: the safetensors at its root), for families
  whose published layout is not a transformers one (sub-folders, ``.bin`` shards, a ``.nemo`` archive);
* :class:`~mmserve.multimodal.processors.InputProcessor` (on the class, before any model exists):
  ``build_processor`` gives the processor (default ``AutoProcessor``; a family without one returns its own with
  the same call: ``processor(text=..., images=..., return_tensors="pt")``, ``.tokenizer``, ``.image_token``);
  ``build_mm_items`` cuts the HF processor's output into one ``MultiModalItem`` per image / video;
  ``prompt_positions`` (spec ``mrope`` / ``own_positions``) gives the prompt's (t, h, w) or own 1-D positions; ``processor_kwargs`` what every
  processor call needs; encoder-decoders' ``decoder_prompt_ids`` / ``call_processor``.
* the model runner (on the instance): ``get_mm_embeddings`` encodes items, ``embed_input_ids`` embeds
  the prompt (item embeddings are then written over the placeholders), ``forward`` runs the language
  model, ``compute_logits`` gives logits; cross-attention families' ``cross_kv*`` size and fill their pool.
  The loader calls ``load_weights`` with the checkpoint's (name, tensor) pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from mmserve.attention.metadata import AttentionMetadata
from mmserve.core.multimodal import MultiModalItem
from mmserve.models.family import TEXT_ONLY, FamilySpec

if TYPE_CHECKING:
    from mmserve.lora.adapter import LoRAAdapter


class MultiModalCausalLM(nn.Module):
    """Base of the family classes: the text path delegates to ``self.language_model``.

    Subclasses set ``self.language_model`` in ``__init__`` and implement ``build_mm_items``,
    ``get_mm_embeddings`` and ``load_weights``; families with positions of their own (spec ``mrope``, ``own_positions``) also ``prompt_positions``.
    """

    language_model: nn.Module
    family: ClassVar[FamilySpec] = TEXT_ONLY  # set by models.family.register_family
    # (checkpoint prefix, our prefix) pairs of the family's weight names, first match wins (models/weights.py)
    weight_renames: list[tuple[str, str]] = []
    # an adapter the checkpoint itself carries (spec media_lora: XComposer2's Partial LoRA), built by load_weights
    builtin_lora: LoRAAdapter | None = None

    @classmethod
    def load_config(cls, model_dir: str) -> Any:
        """The checkpoint's config, with ``architectures`` naming this family; the default reads ``config.json``
        through transformers' ``AutoConfig``."""
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_dir)

    @classmethod
    def checkpoint_weights(cls, model_dir: str) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs, one at a time; the default streams the root's safetensors."""
        from mmserve.models.weights import iter_safetensors

        return iter_safetensors(model_dir)

    @classmethod
    def build_processor(cls, model_dir: str, hf_config: Any) -> Any:
        """The checkpoint's processor: text + pictures -> ``input_ids`` and the encoder's inputs."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(model_dir)

    @classmethod
    def build_mm_items(
        cls, hf_config: Any, enc: Any, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """One ``MultiModalItem`` per image / video of the prompt: its placeholder run in ``ids`` (offset,
        length), its encoder inputs taken from the HF processor output ``enc``, and its cache key."""
        raise NotImplementedError

    @classmethod
    def prompt_positions(
        cls, hf_config: Any, enc: Any, ids: list[int]
    ) -> tuple[torch.Tensor | None, int]:
        """The prompt's positions, [3, P] (t, h, w) for M-RoPE, [1, P] for a family's own 1-D positions (None: the
        tokens' indices), and the delta of every position after the prompt (generated token p sits at p + delta)."""
        raise NotImplementedError

    @classmethod
    def processor_kwargs(
        cls, model_dir: str, hf_config: Any, header_font_path: str | None
    ) -> dict[str, Any]:
        """Keyword arguments every HF processor call of this checkpoint needs (Pix2Struct VQA: its font)."""
        return {}

    def lora_packed_modules(self) -> dict[str, tuple[str, Any]]:
        """The language model's fused linears: part name -> (fused module name, shard id)."""
        return getattr(self.language_model, "packed_modules", {})

    def lora_target_ok(self, module_name: str) -> bool:
        """Whether a LoRA delta can apply to this linear of the language model row by row of the step's flat batch
        (Mllama's cross-attention layers run on a subset of rows and on the image states: not there)."""
        return True

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode ``items``; one [item.length, text_hidden] tensor per item, in order."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint's (name, tensor) pairs, renaming them to our module paths."""
        raise NotImplementedError

    def drop_encoders(self) -> None:
        """Free every submodule but the language model: a tensor-parallel worker runs the text path only (the
        driver encodes the pictures and sends their embeddings merged into the prompt's)."""
        for name, _ in list(self.named_children()):
            if name != "language_model":
                setattr(self, name, None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, text_hidden] of ``input_ids`` [T]."""
        return self.language_model.embed_input_ids(input_ids)

    def forward(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, text_hidden]; ``positions`` [T], or [3, T] (t, h, w) with M-RoPE ([T] = text only)."""
        return self.language_model(inputs_embeds, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of hidden states [N, text_hidden]."""
        return self.language_model.compute_logits(hidden)


class CrossAttentionLM(MultiModalCausalLM):
    """A family whose text attends the encoder's outputs through cross-attention (spec attention "cross" or
    "encoder_decoder"): the runner keeps each request's encoder keys/values in the cross-attention pool
    (worker/cross_kv.py) and passes each step's sequences with media in ``AttentionMetadata.cross``."""

    def cross_kv_layout(self) -> CrossKVLayout:
        """Cross-attention families: what `cross_kv` returns per encoder token (its keys/values of every
        cross-attention layer, [tokens, layers, 2, kv heads, head_dim]), for sizing the cross-attention pool."""
        raise NotImplementedError

    def cross_kv(self, encoded: torch.Tensor) -> torch.Tensor:
        """Cross-attention families: the keys/values the pool stores for one encoder output of `get_mm_embeddings`
        (the identity where that output already is them; Mllama's is the projected image states, whose
        keys/values each tensor-parallel rank computes for its own heads)."""
        return encoded

    def cross_kv_tokens(self, item: MultiModalItem) -> int:
        """Cross-attention families: how many tokens `get_mm_embeddings` returns for `item`, known before
        encoding so the scheduler can hold pool blocks for them."""
        raise NotImplementedError

    @staticmethod
    def cross_item_layout(item: MultiModalItem) -> MultiModalItem:
        """The item as the text model's cross-attention reads it, without its encoder inputs: what a
        tensor-parallel worker gets with each step (default: nothing of its data; Mllama keeps its tile counts)."""
        return dataclasses.replace(item, data={})

    def cross_kv_order(
        self, items: list[MultiModalItem], prompt_len: int
    ) -> tuple[torch.Tensor | None, int]:
        """Cross-attention families: (order, n): the pool keeps a request's concatenated encoder tokens in this
        order (None: as they are), the n its generated tokens attend first. Default: they attend all."""
        return None, sum(self.cross_kv_tokens(it) for it in items)


class EncoderDecoderLM(CrossAttentionLM):
    """An encoder-decoder (spec attention "encoder_decoder"): the prompt is the decoder's, the HF processor sees
    the picture (and the text when the spec's ``encoder_reads_text``)."""

    @classmethod
    def decoder_prompt_ids(cls, hf_config: Any, tokenizer: Any, text: str) -> list[int]:
        """The decoder's prompt ids for the client's `text`."""
        raise NotImplementedError

    @classmethod
    def call_processor(cls, processor: Any, text: str, kwargs: dict[str, Any]) -> Any:
        """The HF processor's outputs for one picture and the text its encoder reads."""
        return processor(text=text, return_tensors="pt", **kwargs)


def check_single_image(image_keys: list[str], video_keys: list[str], required: bool) -> None:
    """Families of one picture per prompt and no video (BLIP-2, Fuyu, Kosmos-2; `required`: the encoder-decoders,
    which read exactly one); ValueError otherwise."""
    if video_keys or len(image_keys) > 1 or (required and not image_keys):
        how = "exactly" if required else "at most"
        raise ValueError(
            f"this model takes {how} one image per prompt, got {len(image_keys)} image(s) and "
            f"{len(video_keys)} video(s)"
        )


@dataclass(frozen=True)
class CrossKVLayout:
    """What a cross-attention family's encoder yields per token: keys and values of `layers` cross-attention
    layers (the cross-attention pool's shape, worker/cross_kv.py; its dtype is the model's)."""

    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype.itemsize
