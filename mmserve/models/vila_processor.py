"""VILA's prompt and picture preparation, which its checkpoints ship no HF processor for.

Text: the prompt is cut at each `<image>`; every chunk is tokenized on its own with the tokenizer's special tokens
and, when the first chunk starts with BOS, each chunk's first id (its BOS) is dropped but the first chunk's
(`llava/mm_utils.py: tokenizer_image_token`); each picture's tokens sit where its `<image>` was. Pictures:
`image_aspect_ratio` "resize" resizes to the tower's square with PIL's default (bicubic) first, "pad" pastes the
picture centred on a square of the processor's mean colour (`process_image`, `expand2square`); then the tower's
own image processor (`vision_tower/preprocessor_config.json`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image

# vicuna_v1, the conversation template of VILA1.5-3b / 13b (llava/conversation.py): pictures first in a user turn
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}{{- SYSTEM + ' ' -}}{%- endif -%}"
    "{%- set content = message['content'] -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{- part['text'] + ' ' -}}{%- endfor -%}"
    "{%- elif message['role'] == 'user' -%}{{- 'USER: ' -}}"
    "{%- for part in content if part['type'] == 'image' -%}{{- '<image>\\n' -}}{%- endfor -%}"
    "{%- for part in content if part['type'] == 'text' -%}{{- part['text'] + ' ' -}}{%- endfor -%}"
    "{%- else -%}{{- 'ASSISTANT: ' -}}"
    "{%- for part in content if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{{- EOS -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"
)


class VilaImageProcessor:
    """Pictures → `pixel_values` [N, 3, S, S]: squared by `image_aspect_ratio`, then the tower's processor."""

    def __init__(self, transform: Any, aspect: str) -> None:
        if aspect not in ("resize", "pad"):
            raise ValueError(f"VILA image_aspect_ratio {aspect!r} is not supported (resize, pad)")
        self.transform, self.aspect = transform, aspect

    def __call__(
        self, images: list[Image.Image], return_tensors: str = "pt", **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        squared = [self._square(im.convert("RGB")) for im in images]
        return dict(self.transform(squared, return_tensors="pt", **kwargs))

    def _square(self, image: Image.Image) -> Image.Image:
        size = self.transform.size
        side = size.get("height") or size.get("shortest_edge")
        if self.aspect == "resize":
            return image.resize((side, side))
        w, h = image.size
        if w == h:
            return image
        fill = tuple(int(m * 255) for m in self.transform.image_mean)
        square = Image.new(image.mode, (max(w, h), max(w, h)), fill)
        square.paste(image, ((max(w, h) - w) // 2, (max(w, h) - h) // 2))
        return square


class VilaProcessor:
    """Called as an HF processor: `processor(text=..., images=..., return_tensors="pt")` gives `input_ids`
    [1, P], `pixel_values` [N, 3, H, W] and `image_spans` ((offset, length) per picture, in order)."""

    image_token = "<image>"

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        tokens_per_image: int,
        placeholder_id: int,
        aspect: str = "resize",
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = VilaImageProcessor(image_processor, aspect)
        self.tokens_per_image = tokens_per_image
        self.placeholder_id = placeholder_id
        own = getattr(tokenizer, "chat_template", None)
        from mmserve.models.vila import SYSTEM

        eos = tokenizer.eos_token or ""
        self.chat_template = own or CHAT_TEMPLATE.replace("SYSTEM", repr(SYSTEM)).replace(
            "EOS", repr(eos)
        )

    @classmethod
    def from_checkpoint(
        cls, model_dir: str, hf_config: Any, tokens_per_image: int
    ) -> VilaProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        root = Path(model_dir)
        return cls(
            AutoTokenizer.from_pretrained(root / "llm"),
            AutoImageProcessor.from_pretrained(root / "vision_tower"),
            tokens_per_image,
            hf_config.image_token_index,
            hf_config.image_aspect_ratio,
        )

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, **kwargs
        )

    def prompt_ids(self, text: str, num_images: int) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, each picture's (offset, length)) for `text` with `num_images` `<image>` placeholders."""
        chunks = [self.tokenizer(c).input_ids for c in text.split(self.image_token)]
        if len(chunks) - 1 != num_images:
            raise ValueError(
                f"the prompt has {len(chunks) - 1} {self.image_token} placeholder(s) "
                f"but {num_images} image(s) were given"
            )
        bos = self.tokenizer.bos_token_id
        skip = 1 if chunks[0] and chunks[0][0] == bos else 0
        ids: list[int] = list(chunks[0][:skip])
        spans = []
        for k, chunk in enumerate(chunks):
            if k:
                spans.append((len(ids), self.tokens_per_image))
                ids += [self.placeholder_id] * self.tokens_per_image
            ids += chunk[skip:]
        return ids, spans

    def __call__(
        self,
        text: str,
        images: list[Image.Image] | None = None,
        return_tensors: str = "pt",
        **kwargs: Any,
    ) -> dict[str, Any]:
        images = list(images or [])
        ids, spans = self.prompt_ids(text, len(images))
        out: dict[str, Any] = {"input_ids": torch.tensor([ids]), "image_spans": spans}
        if images:
            out["pixel_values"] = self.image_processor(images, **kwargs)["pixel_values"]
        return out
