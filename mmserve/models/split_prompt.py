"""Processors for families whose checkpoints ship no HF processor and whose pictures are squares: the picture
transform (`SquarePictures`: bicubic resize straight to the square, rescale, normalise: torchvision's `Resize`,
`ToTensor`, `Normalize` as the originals' `vis_processor`s) and the prompt cut at a picture tag
(`SplitPromptProcessor`: each text part tokenized on its own, each picture a run of placeholder ids).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class SquarePictures:
    """Pictures → `pixel_values` [N, 3, S, S] (called as an HF image processor)."""

    def __init__(
        self, size: int, mean: tuple[float, ...] = CLIP_MEAN, std: tuple[float, ...] = CLIP_STD
    ) -> None:
        self.size = size
        self.mean = torch.tensor(mean)[:, None, None]
        self.std = torch.tensor(std)[:, None, None]

    def __call__(self, images: list[Image.Image], **kwargs: Any) -> dict[str, torch.Tensor]:
        out = []
        for im in images:
            rgb = im.convert("RGB").resize((self.size, self.size), Image.BICUBIC)
            x = torch.from_numpy(np.asarray(rgb, np.float32) / 255.0).permute(2, 0, 1)
            out.append((x - self.mean) / self.std)
        return {"pixel_values": torch.stack(out)}


class SplitPromptProcessor:
    """`processor(text=..., images=...)` → `input_ids` [1, P], `pixel_values` and `image_spans`: the text cut at
    `image_token`, each non-empty part tokenized alone (`special_tokens`: with the tokenizer's BOS), each picture
    `rows` copies of `placeholder_id` where its tag was."""

    def __init__(
        self,
        tokenizer: Any,
        pictures: SquarePictures,
        image_token: str,
        rows: int,
        placeholder_id: int,
        special_tokens: bool,
        chat_template: str | None,
    ) -> None:
        self.tokenizer, self.image_processor, self.image_token = tokenizer, pictures, image_token
        self.rows, self.placeholder_id, self.special_tokens = rows, placeholder_id, special_tokens
        self.chat_template = chat_template

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, **kwargs
        )

    def __call__(
        self, text: str, images: list | None = None, return_tensors: str = "pt", **kw: Any
    ) -> dict[str, Any]:
        parts = text.split(self.image_token)
        ids: list[int] = []
        spans = []
        for i, part in enumerate(parts):
            if part:
                ids += self.tokenizer(part, add_special_tokens=self.special_tokens).input_ids
            if i < len(parts) - 1:
                spans.append((len(ids), self.rows))
                ids += [self.placeholder_id] * self.rows
        out: dict[str, Any] = {"input_ids": torch.tensor([ids]), "image_spans": spans}
        if images:
            out["pixel_values"] = self.image_processor(images)["pixel_values"]
        return out
