"""The seeds' `multimodal_encoders` model (PROTOCOL §1.4): preprocessed pictures (`IMAGE`, or `pixel_values` as
`preprocessing` returns them in PIXEL_VALUES) -> the prompt embedding table the seeds hand to `tensorrt_llm`:
OUT_PROMPT_EMBEDDING_TABLE [batch, rows, hidden] fp16 (the vision tower and projector's output, the batch item's
pictures one after the other, zero rows after a shorter item) and OUT_PROMPT_VOCAB_SIZE [batch, 1] (each item's
rows). The pictures go through the served processor as the ensemble's `image_input` does (their placeholders
expand as for pictures of that size), then AsyncEngine.encode_media runs the encoder on the engine thread.

Families whose pictures do not enter the prompt as a run of embeddings have no such table (`no_table_reason`):
their requests are 400s naming the family."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton.prompts import build_prompt
from mmserve.entrypoints.triton.tensors import pixel_values
from mmserve.models.family import FamilySpec

PICTURE_INPUTS = ("IMAGE", "pixel_values")  # the seeds' two names for the same preprocessed pixels
_OTHER_MODEL_TYPES = (  # inputs of the seeds' mllama / qwen2_vl / llava_onevision encoders
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "cross_attention_mask",
    "max_tokens",
    "image_sizes",
    "attention_mask",
    "image_grid_thw",
    "vision_input_id",
)


def no_table_reason(family: FamilySpec) -> str | None:
    """Why this family's pictures have no prompt embedding table (the rule prompt_table.prompt_table_items keeps
    for `tensorrt_llm`'s prompt_embedding_table); None when they have one."""
    if family.encoder_decoder:
        return "an encoder-decoder, its decoder reads the pictures through cross-attention"
    if family.cross_attention:
        return "its text reads the pictures through cross-attention layers"
    if family.mrope:
        return "its pictures' positions (M-RoPE) come from their grids, not from table rows"
    if family.own_positions:
        return "its pictures' tokens take positions and weights of their own (visual expert)"
    return None


def picture_input(tensors: dict[str, np.ndarray]) -> str:
    """The name the request's pictures come under (one of PICTURE_INPUTS)."""
    given = [name for name in PICTURE_INPUTS if name in tensors and tensors[name].size]
    if len(given) > 1:
        raise ValueError("IMAGE and pixel_values are the same input: give one of them")
    if not given:
        raise ValueError(
            "IMAGE is required (or pixel_values): the preprocessed pictures to encode, "
            "[batch, pictures, 3, H, W] FP16"
        )
    return given[0]


async def encode_pictures(
    state: ServerState, tensors: dict[str, np.ndarray], batch: int
) -> dict[str, np.ndarray]:
    """Checked input tensors (aux_models.checked_inputs) -> OUT_PROMPT_EMBEDDING_TABLE, OUT_PROMPT_VOCAB_SIZE."""
    info = state.engine.model_info
    reason = no_table_reason(info.family)
    if reason is not None:
        raise ValueError(
            f"multimodal_encoders: the served model's family '{info.family.name}' has no prompt embedding "
            f"table ({reason}); send its pictures to ensemble or tensorrt_llm_bls"
        )
    field = picture_input(tensors)
    for name in _OTHER_MODEL_TYPES:
        if name in tensors:
            raise ValueError(
                f"{name}: not read by the '{info.family.name}' family's encoder (only IMAGE or pixel_values)"
            )
    if "is_video_input" in tensors and tensors["is_video_input"].any():
        raise ValueError(
            "is_video_input: video pixels are not taken here; send the frames as video_bytes_input "
            "to ensemble or tensorrt_llm_bls"
        )
    tables = await asyncio.gather(
        *(_item_table(state, field, tensors[field][b]) for b in range(batch))
    )
    hidden = tables[0].shape[1]
    rows = max(len(t) for t in tables)
    out = np.zeros((batch, rows, hidden), np.float16)
    for b, table in enumerate(tables):
        out[b, : len(table)] = table.numpy()
    return {
        "OUT_PROMPT_EMBEDDING_TABLE": out,
        "OUT_PROMPT_VOCAB_SIZE": np.array([[len(t)] for t in tables], np.int32),
    }


async def _item_table(state: ServerState, field: str, arr: np.ndarray) -> torch.Tensor:
    """One batch item's pictures -> their embeddings, one after the other, [rows, hidden] fp16."""
    try:
        pixels = pixel_values(arr)
    except ValueError as exc:
        raise ValueError(str(exc).replace("image_input", field)) from exc
    limit = state.media.max_images_per_request
    if len(pixels) > limit:
        raise ValueError(f"{field}: {len(pixels)} pictures, max_images_per_request={limit}")
    info = state.engine.model_info
    text = build_prompt(
        state.model_type,
        "",
        len(pixels),
        wrap=False,
        field=field,
        image_token=info.image_token,
        video_token=info.video_token,
    )
    try:
        inputs = await state.engine.preprocess({"prompt": text, "pixel_values": pixels})
    except (ValueError, TypeError) as exc:
        raise ValueError(_own_field(str(exc), field)) from exc
    if not inputs.mm_items:
        raise ValueError(
            f"{field}: the '{info.family.name}' family's processor made no picture of it"
        )
    embeddings = await state.engine.encode_media(inputs)
    return torch.cat(embeddings).half()


def _own_field(message: str, field: str) -> str:
    """A processor message about the pictures, naming the input they came in."""
    return message if message.startswith(field) else f"{field}: {message}"
