"""The declared contract of a model family: what the server outside `models/` may know about one.

A family file declares a frozen :class:`FamilySpec` and registers its class with it
(`models/registry.py`)::

    @register_family(FamilySpec(name="llava", architectures=("LlavaForConditionalGeneration",), ...))
    class LlavaForConditionalGeneration(MultiModalCausalLM): ...

Everything outside `models/` reads the spec, never a flag probed on the model: the runner
(``model.family.mrope``), the input processor, the Triton prompt builder (``prompt``), the client (``client``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["self", "cross", "encoder_decoder"]


@dataclass(frozen=True)
class PromptFormat:
    """How the Triton preprocessing model wraps a client's `text_input` for this family (PROTOCOL §6)."""

    image_token: (
        str | None
    )  # placeholder the HF processor expands; None: images are implicit (BLIP-2)
    pre_prompt: str = ""
    post_prompt: str = ""
    image_sep: str = ""  # between the image placeholders and the text when placeholders are added
    prepend_images: bool = (
        False  # placeholders go before the pre-prompt (the text starts with them)
    )
    video_token: str | None = None  # None: the family takes no video


@dataclass(frozen=True)
class ClientFormat:
    """How the seeds' client (`mmserve client --model_type NAME`) sends a request of this family (PROTOCOL §5)."""

    model_type: str  # its --model_type choice
    preprocessed: bool = (
        False  # with --hf_model_dir: HF-processed FP16 `image_input` instead of image bytes
    )
    padded_sizes: bool = False  # zero-padded `image_bytes_input` plus `image_sizes_input` [1, N, 2]
    video: bool = True  # False: --video is not sent (the family reads pictures only)
    resize: tuple[int, int] | None = None  # (w, h) every picture is resized to before sending


@dataclass(frozen=True)
class FamilySpec:
    """One family: how a checkpoint is recognised, how its prompts look and what its model can do."""

    name: str
    # HF config.architectures[0] values it serves; `config_matches` decides between families sharing one
    architectures: tuple[str, ...] = ()
    config_matches: Callable[[Any], bool] | None = None
    # a checkpoint without config.json, recognised by a file in its directory matching this pattern ("*.nemo")
    checkpoint_file: str | None = None
    # HF config.model_type spellings (and the seeds' names) its Triton prompt format answers to
    model_types: tuple[str, ...] = ()
    # None: no pre/post prompt, the processor's own placeholders
    prompt: PromptFormat | None = None
    # None: the seeds' client has no --model_type for it
    client: ClientFormat | None = None
    # cross: the text attends the encoder through cross-attention layers (Mllama); encoder_decoder: the
    # prompt is the decoder's (Nougat); both need a CrossAttentionLM class (models/base.py)
    attention: AttentionKind = "self"
    # positions [3, T] (t, h, w) instead of [T]; the class defines prompt_positions
    mrope: bool = False
    # 1-D positions of its own rather than the tokens' indices (CogVLM: a picture's tokens share one); the class
    # defines prompt_positions ([1, P])
    own_positions: bool = False
    # False: the HF processor lays out the placeholder tokens itself
    placeholder_in_prompt: bool = True
    # encoder-decoders whose encoder input holds the text (BLIP-2 T5, Pix2Struct VQA)
    encoder_reads_text: bool = False
    # get_mm_embeddings of equally shaped items has no host syncs and no data-dependent shapes: CUDA graphs
    encoder_cuda_graphs: bool = False
    # cross-attention families whose decode steps replay CUDA graphs
    cross_decode_graphs: bool = False
    # linear layers whose weights depend on each token's modality (CogVLM's visual expert, XComposer2's Partial
    # LoRA): which rows of a picture's span take the picture's weights, "span" (all) or "span_but_last" (its
    # last token, CogVLM's eoi, takes the text's); the runner passes them as `AttentionMetadata.media_rows`
    media_rows: Literal["span", "span_but_last"] | None = None
    # LoRA applies to picture rows only (XComposer2's Partial LoRA): the model's `builtin_lora` unless the request
    # names its own adapter, which then replaces it
    media_lora: bool = False
    # its HF processor takes a batch's pictures as one list per prompt (the transformers baseline's batches)
    images_per_prompt_lists: bool = False

    @property
    def cross_attention(self) -> bool:
        """The text attends the encoder's outputs through cross-attention (kept in the cross-attention pool)."""
        return self.attention != "self"

    @property
    def encoder_decoder(self) -> bool:
        """The prompt is the decoder's; the HF processor sees the picture (and, if it reads it, the text)."""
        return self.attention == "encoder_decoder"


TEXT_ONLY = FamilySpec(
    name="text"
)  # what a class outside the registry (a bare language model) can do


@dataclass(frozen=True)
class TextShape:
    """The sizes of a language model that one decode step reads (the bench's weight-read roofline, bench/roofline.py).

    Llama-style decoders keep the defaults; the text model's module registers how to read its config.json
    (`registry.register_text_shape`). Cross-attention k/v projections of the encoder output run once per request
    and are not counted."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    mlp_matrices: int = 3  # gate/up/down (SwiGLU) or fc1/fc2
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_norm: bool = False  # LayerNorm (scale + shift) instead of RMSNorm (scale)
    final_norm: bool = True
    embed_dim: int | None = (
        None  # word-embedding width when it differs from hidden (OPT-350m style)
    )
    cross_layers: int = (
        0  # how many of `layers` are cross-attention layers without a KV cache (Mllama)
    )
    qk_norm: bool = False  # a q and a k norm over head_dim per self-attention layer (Persimmon)
    sub_layer_norm: bool = (
        False  # LayerNorms over the attention output and the MLP's inner width (Kosmos-2)
    )
    cross_attention: bool = False  # every layer also attends the encoder's output (MBart, T5)
    embed_norm: bool = (
        False  # a LayerNorm over the (scaled) embeddings before the first layer (MBart)
    )


def basic_sizes(text: dict[str, Any]) -> dict[str, int]:
    """hidden, layers, heads, head_dim and vocab of a text config.json that uses the common key names."""
    heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
    return dict(
        hidden=hidden,
        layers=int(text["num_hidden_layers"]),
        heads=heads,
        head_dim=int(text.get("head_dim") or hidden // heads),
        vocab=int(text["vocab_size"]),
    )
