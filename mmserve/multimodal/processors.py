"""InputProcessor: prompt text + media -> prompt token ids and MultiModalItems (placeholders expanded).

The family's own HF processor does resizing, normalisation and placeholder expansion, so our
token ids are exactly what `transformers` would feed the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from transformers import AutoProcessor

from mmserve.engine.request import MultiModalItem
from mmserve.multimodal.hashing import hash_bytes, hash_image
from mmserve.multimodal.inputs import MediaConfig, load_images


@dataclass
class ProcessedInputs:
    prompt: str | None
    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem] = field(default_factory=list)


def _placeholder_runs(ids: list[int], token_id: int, num_items: int) -> list[tuple[int, int]]:
    """Split the positions of token_id into num_items equal contiguous (offset, length) runs."""
    pos = [i for i, t in enumerate(ids) if t == token_id]
    if num_items == 0:
        return []
    if len(pos) % num_items:
        raise ValueError(f"{len(pos)} image tokens cannot be split evenly over {num_items} images")
    n = len(pos) // num_items
    runs = []
    for k in range(num_items):
        chunk = pos[k * n:(k + 1) * n]
        if chunk[-1] - chunk[0] != n - 1:
            raise ValueError("image placeholder tokens are not contiguous")
        runs.append((chunk[0], n))
    return runs


class InputProcessor:
    """Prompt building for one checkpoint. `prompt` is a str or a dict with keys
    prompt | prompt_token_ids, images, image_ids (client-given identities, e.g. prompt_table_extra_id)."""

    def __init__(self, model_dir: str, hf_config, media: MediaConfig | None = None) -> None:
        self.hf_config = hf_config
        self.media = media or MediaConfig()
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.image_token = getattr(self.processor, "image_token", None) or "<image>"
        self.image_token_id = getattr(hf_config, "image_token_index", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(hf_config, "image_token_id", None)

    def process(self, prompt: str | dict[str, Any]) -> ProcessedInputs:
        """Raises ValueError/TypeError naming the problem for any bad input."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "images", "image_ids", "pixel_values"}
        if unknown:
            raise ValueError(f"unknown prompt keys: {sorted(unknown)}")
        images = prompt.get("images") or []
        if not isinstance(images, (list, tuple)):
            images = [images]
        pixel_values = prompt.get("pixel_values")
        if pixel_values is not None:
            if images:
                raise ValueError("give either images or pixel_values, not both")
            pixel_values = self._check_pixel_values(pixel_values)
            images = [None] * len(pixel_values)
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        if token_ids is not None:
            if images:
                raise ValueError("images need a text prompt (prompt_token_ids cannot carry image placeholders)")
            if not token_ids or not all(isinstance(t, int) and t >= 0 for t in token_ids):
                raise ValueError("prompt_token_ids must be a non-empty list of non-negative ints")
            return ProcessedInputs(text, list(token_ids))
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a string, got {type(text).__name__}")
        num_placeholders = text.count(self.image_token)
        if num_placeholders != len(images):
            raise ValueError(f"the prompt has {num_placeholders} {self.image_token} placeholder(s) "
                             f"but {len(images)} image(s) were given")
        if not images:
            ids = self.tokenizer(text).input_ids
            if not ids:
                raise ValueError("prompt is empty")
            return ProcessedInputs(text, ids)
        ids_given = prompt.get("image_ids")
        if ids_given is not None and len(ids_given) != len(images):
            raise ValueError(f"image_ids has {len(ids_given)} entries for {len(images)} images")
        if pixel_values is None:
            pil_images = load_images(list(images), self.media)
            keys = [hash_image(im) for im in pil_images]
        else:  # already preprocessed: placeholders expand as for images of the same size
            h, w = pixel_values.shape[-2:]
            pil_images = [Image.new("RGB", (w, h)) for _ in range(len(pixel_values))]
            keys = [hash_bytes(pv.contiguous().float().numpy().tobytes()) for pv in pixel_values]
        enc = self.processor(text=text, images=pil_images, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        if pixel_values is None:
            pixel_values = enc["pixel_values"]
        elif pixel_values.shape[1:] != enc["pixel_values"].shape[1:]:
            raise ValueError(f"pixel_values have shape {list(pixel_values.shape[1:])} per image but this model "
                             f"expects {list(enc['pixel_values'].shape[1:])}")
        items = []
        for k, (offset, length) in enumerate(_placeholder_runs(ids, self.image_token_id, len(images))):
            key = f"id:{ids_given[k]}" if ids_given is not None else keys[k]
            items.append(MultiModalItem("image", {"pixel_values": pixel_values[k]}, offset, length, key))
        return ProcessedInputs(text, ids, items)

    @staticmethod
    def _check_pixel_values(pixel_values) -> torch.Tensor:
        pv = torch.as_tensor(pixel_values)
        if pv.dim() == 3:
            pv = pv.unsqueeze(0)
        if pv.dim() != 4 or pv.shape[1] != 3 or not pv.is_floating_point():
            raise ValueError(f"pixel_values must be a float tensor [num_images, 3, H, W], got "
                             f"{pv.dtype} {list(pv.shape)}")
        if not torch.isfinite(pv).all():
            raise ValueError("pixel_values contain NaN or infinite values")
        return pv.float()

    def apply_chat_template(self, messages: list[dict]) -> tuple[str, list[Any]]:
        """OpenAI-style messages -> (prompt text, images in order). Content parts: text, image_url, image."""
        hf_messages, images = [], []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message needs a 'role'")
            content = m.get("content", "")
            if isinstance(content, str):
                hf_messages.append({"role": m["role"], "content": [{"type": "text", "text": content}]})
                continue
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif kind in ("image_url", "image"):
                    src = part.get("image_url", part.get("image"))
                    images.append(src["url"] if isinstance(src, dict) else src)
                    parts.append({"type": "image"})
                else:
                    raise ValueError(f"unsupported content part type {kind!r}")
            hf_messages.append({"role": m["role"], "content": parts})
        prompt = self.processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        return prompt, images
