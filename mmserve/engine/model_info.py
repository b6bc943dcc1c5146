"""What the frontends may know of the served model: one immutable object, built once the engine has started."""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.models.family import FamilySpec


@dataclass(frozen=True)
class ModelInfo:
    """The served checkpoint as the APIs see it (`AsyncEngine.model_info`)."""

    family: FamilySpec  # its declared contract: prompt format, attention kind, ...
    max_model_len: int  # prompt + generated tokens of one request
    vocab_size: int  # ids at or above it mark prompt-table rows (Triton prompt_table)
    block_size: int  # tokens per KV-cache block
    image_token: str | None  # the processor's image placeholder
    video_token: str | None  # the processor's video placeholder (None: no video)
