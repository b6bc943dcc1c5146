"""A prompt's pictures and videos after preprocessing, and the processed inputs the engine queues: the plain data
that the input processor makes, the families lay out and the runner encodes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MultiModalItem:
    """One image (or video) of a prompt, after preprocessing.

    Its `length` placeholder tokens start at `offset` in the prompt; the encoder turns `data`
    into exactly `length` embeddings that replace those tokens' embeddings.
    """

    modality: str  # "image" | "video"
    data: dict[str, torch.Tensor]  # encoder inputs, e.g. {"pixel_values": [3, H, W]}
    offset: int
    length: int
    content_hash: str  # identity for the prefix and encoder caches
    # the first prompt position whose keys/values depend on the item, where that is not its offset: 0 for
    # cross-attention families, whose text before the image attends it too (the prefix cache hashes it there)
    kv_from: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class ProcessedInputs:
    prompt: str | None
    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem] = field(default_factory=list)
    # [3, P] for M-RoPE families (Qwen2-VL), [1, P] for a family's own 1-D positions (CogVLM); None: indices
    prompt_positions: torch.Tensor | None = None
    position_delta: int = 0  # decode position p maps to p + delta (on all 3 axes)
    lora: str | None = None  # the LoRA adapter the request names (checked by the engine)
    # (block size, chained KV block hashes of the prompt's full blocks), made by Engine.preprocess
    block_hashes: tuple[int, list[bytes]] | None = None

    def __post_init__(self) -> None:
        self.mm_items = sorted(
            self.mm_items, key=lambda m: m.offset
        )  # prompt order: hashes, scheduling
