"""InputProcessor: prompt text + media -> prompt token ids and MultiModalItems (placeholders expanded).

The family's own HF processor does resizing, normalisation and placeholder expansion, so our
token ids are exactly what `transformers` would feed the model. Its parts live beside it: the bounded caches
(bounded_lru.py), chat messages -> prompt (chat_prompt.py), the media's checks and loading (prompt_media.py),
the encoder-decoder route (encoder_decoder_prompt.py) and the per-thread CUDA streams (preprocess_streams.py).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmserve.core.multimodal import MultiModalItem, ProcessedInputs
from mmserve.multimodal.bounded_lru import BoundedLRU, inputs_bytes, tensor_bytes
from mmserve.multimodal.chat_prompt import chat_prompt
from mmserve.multimodal.encoder_decoder_prompt import (
    checked_decoder_prompt,
    decoder_ids,
    encoder_outputs,
)
from mmserve.multimodal.hashing import hash_bytes, hash_image, hash_video
from mmserve.multimodal.inputs import load_images
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.multimodal.placeholder_expansion import PlaceholderExpansion
from mmserve.multimodal.preprocess_streams import PreprocessStreams
from mmserve.multimodal.prompt_media import as_list, check_pixel_values, load_videos
from mmserve.multimodal.prompt_table import prompt_table_items

try:  # transformers' torchvision image processors (its default "fast" ones)
    from transformers.image_processing_backends import TorchvisionBackend
except ImportError:  # an older transformers
    TorchvisionBackend = None

# importable from here, as BoundedLRU is (tests/unit/test_cache_caps.py imports both)


class InputProcessor:
    """Prompt building for one checkpoint. `prompt` is a str or a dict with keys prompt | prompt_token_ids,
    images, videos, video_num_frames, image_ids (client-given identities, e.g. prompt_table_extra_id),
    pixel_values (already-preprocessed images [N, 3, H, W]), prompt_table (with prompt_token_ids: visual
    features [F, hidden] that ids from the vocabulary size on stand for, multimodal/prompt_table.py),
    decoder_prompt (encoder-decoder models: text the decoder's answer starts with, after its start token).

    The model class supplies the family-specific part: `build_mm_items(hf_config, enc, ids, image_keys,
    video_keys)` turns the HF processor's outputs into MultiModalItems, and, for M-RoPE families,
    `prompt_positions(hf_config, enc, ids)` gives the prompt's 3-axis (or own 1-D) positions.
    """

    KEYS = {
        "prompt",
        "prompt_token_ids",
        "images",
        "videos",
        "video_num_frames",
        "image_ids",
        "pixel_values",
        "lora",
        "prompt_table",
        "prompt_table_extra_ids",
        "decoder_prompt",
    }
    # LRU caches, bounded in entries and in bytes (their tensors, on the preprocessing device: the GPU where the HF
    # image processor runs there): a picture's pixels are 1.3 MB for LLaVA-1.5, up to ~300 MB for Qwen2-VL
    RECENT_INPUTS = 64  # processed media prompts kept for exact repeats
    RECENT_INPUTS_BYTES = 256 * 2**20
    RECENT_IMAGES = 16  # image processor outputs by the pictures' content (a new question on one)
    RECENT_IMAGES_BYTES = 128 * 2**20

    def __init__(
        self,
        model_dir: str,
        hf_config,
        model_cls,
        media: MediaConfig | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.hf_config = hf_config
        self.device = device  # where the HF image processor resizes/normalises (None: CPU)
        self._streams = PreprocessStreams(device)  # one CUDA stream per preprocessing thread
        self._recent = BoundedLRU(self.RECENT_INPUTS, self.RECENT_INPUTS_BYTES, inputs_bytes)
        self._recent_images = BoundedLRU(
            self.RECENT_IMAGES,
            self.RECENT_IMAGES_BYTES,  # guarded by _recent_lock too
            lambda out: tensor_bytes(out.values()),
        )
        self._recent_lock = threading.Lock()
        self.model_cls = model_cls
        self.media = media or MediaConfig()
        self.processor = model_cls.build_processor(model_dir, hf_config)
        # what every processor call of this family needs (Pix2Struct VQA: the font its question is drawn in)
        self._family_kwargs = model_cls.processor_kwargs(
            model_dir, hf_config, self.media.header_font_path
        )
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.image_token = getattr(self.processor, "image_token", None) or "<image>"
        self.video_token = getattr(self.processor, "video_token", None)
        self.image_token_id = getattr(hf_config, "image_token_index", None)
        if self.image_token_id is None:
            self.image_token_id = getattr(hf_config, "image_token_id", None)
        # BLIP-2 style: the processor itself puts the image's query tokens in front of the text
        self.placeholder_in_prompt = model_cls.family.placeholder_in_prompt
        image_processor = getattr(self.processor, "image_processor", None)
        self._expansion = (
            None  # images only: tokenize the prompt as written, repeat the placeholder id
        )
        if (
            self.placeholder_in_prompt
            and self.image_token_id is not None
            and image_processor is not None
        ):
            # Pixtral's processor closes rows with [IMG_BREAK] and the image with [IMG_END]: part of the expansion
            closing = [
                getattr(self.processor, name, None)
                for name in ("image_break_token", "image_end_token")
            ]
            run_ids = frozenset(self.tokenizer.convert_tokens_to_ids(t) for t in closing if t)
            self._expansion = PlaceholderExpansion(self.tokenizer, self.image_token_id, run_ids)

    def clear_recent(self) -> None:
        """Forget the processed prompts kept for exact repeats and the image processor outputs kept by picture
        (the next repeat runs the HF processor)."""
        with self._recent_lock:
            self._recent.clear()
            self._recent_images.clear()

    def blank_image_item(self, size: tuple[int, int] = (512, 512)) -> MultiModalItem | None:
        """The item of one blank picture of `size` (w, h) as this checkpoint's processor prepares it, for warm-ups
        that need the encoder's real input shapes; None for a model without image input."""
        if self.image_token_id is None and self.placeholder_in_prompt:
            return None
        text = self.image_token if self.placeholder_in_prompt else "a"
        items = self.process(
            {"prompt": text, "images": [Image.new("RGB", size, (128, 128, 128))]}
        ).mm_items
        return items[0] if items else None

    def process(self, prompt: str | dict[str, Any]) -> ProcessedInputs:
        """Raises ValueError/TypeError naming the problem for any bad input."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - self.KEYS
        if unknown:
            raise ValueError(f"unknown prompt keys: {sorted(unknown)}")
        lora = prompt.get("lora")
        if lora is not None and (not isinstance(lora, str) or not lora):
            raise ValueError(f"lora: must be an adapter name (a non-empty string), got {lora!r}")
        images, videos = as_list(prompt.get("images")), as_list(prompt.get("videos"))
        pixel_values = prompt.get("pixel_values")
        if pixel_values is not None:
            if images:
                raise ValueError("give either images or pixel_values, not both")
            pixel_values = check_pixel_values(pixel_values)
            images = [None] * len(pixel_values)
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        decoder_prompt = checked_decoder_prompt(prompt.get("decoder_prompt"), self.model_cls)
        if token_ids is not None:
            if images or videos:
                raise ValueError(
                    "media need a text prompt (prompt_token_ids cannot carry placeholders)"
                )
            if not token_ids or not all(isinstance(t, int) and t >= 0 for t in token_ids):
                raise ValueError("prompt_token_ids must be a non-empty list of non-negative ints")
            if prompt.get("prompt_table") is not None:
                ids, items = prompt_table_items(
                    list(token_ids),
                    prompt["prompt_table"],
                    self.hf_config,
                    self.model_cls,
                    self.image_token_id,
                    prompt.get("prompt_table_extra_ids"),
                )
                return ProcessedInputs(text, ids, items, lora=lora)
            return self._with_positions(ProcessedInputs(text, list(token_ids), lora=lora), None)
        if prompt.get("prompt_table") is not None:
            raise ValueError(
                "prompt_table: goes with prompt_token_ids (ids from the vocabulary size on mark its rows)"
            )
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a string, got {type(text).__name__}")
        self._check_placeholders(text, len(images), len(videos))
        if not images and not videos:
            if self.model_cls.family.encoder_decoder:
                raise ValueError("images: this model reads one picture per prompt, none was given")
            if self.placeholder_in_prompt:
                ids = self.tokenizer(text).input_ids
            else:  # the processor lays out these families' prompts, text-only ones too (Kosmos-2: no </s> at the end)
                ids = self.processor(text=text, return_tensors="pt")["input_ids"][0].tolist()
            if not ids:
                raise ValueError("prompt is empty")
            return self._with_positions(ProcessedInputs(text, ids, lora=lora), None)
        ids_given = prompt.get("image_ids")
        if ids_given is not None and len(ids_given) != len(images):
            raise ValueError(f"image_ids has {len(ids_given)} entries for {len(images)} images")
        kwargs: dict[str, Any] = {}
        image_keys: list[str] = []
        if (
            pixel_values is not None
        ):  # already preprocessed: placeholders expand as for images of that size
            h, w = pixel_values.shape[-2:]
            kwargs["images"] = [Image.new("RGB", (w, h)) for _ in range(len(pixel_values))]
            image_keys = [
                hash_bytes(pv.contiguous().float().numpy().tobytes()) for pv in pixel_values
            ]
        elif images:
            kwargs["images"] = load_images(list(images), self.media)
            image_keys = [hash_image(im) for im in kwargs["images"]]
        video_keys: list[str] = []
        if videos:
            frames = self._load_videos(videos, prompt.get("video_num_frames", 8))
            kwargs["videos"] = frames
            video_keys = [hash_video(f) for f in frames]
        # the same text with the same pictures (by content) gives the same inputs: skip the HF processor
        cache_key = (
            text,
            tuple(image_keys),
            tuple(video_keys),
            tuple(ids_given or ()),
            pixel_values is not None,
            lora,
            decoder_prompt,
        )
        with self._recent_lock:  # servers preprocess on several threads
            cached = self._recent.get(cache_key)
            if cached is not None:
                return cached
        content_keys = image_keys
        if ids_given is not None:
            image_keys = [f"id:{i}" for i in ids_given]
        if self.device is not None:
            kwargs["device"] = str(self.device)
        kwargs.update(self._family_kwargs)
        images_key = (str(self.device), tuple(content_keys))
        if self.model_cls.family.encoder_decoder:  # the prompt is the decoder's
            enc = encoder_outputs(
                self.model_cls,
                self.processor,
                text,
                kwargs,
                self._streams.run,
                lambda: self._recent_image_outputs(images_key, kwargs),
            )
            decoder = decoder_ids(
                self.model_cls, self.hf_config, self.tokenizer, text, decoder_prompt
            )
            enc["input_ids"] = torch.tensor([decoder])
        else:
            enc = self._encode(
                text, kwargs, shortcut=pixel_values is None and not videos, images_key=images_key
            )
        if pixel_values is not None:
            if "pixel_values" not in enc:  # Pix2Struct: flattened patches drawn with the question
                raise ValueError(
                    "pixel_values: this model does not take preprocessed pixels; send the images"
                )
            if pixel_values.shape[1:] != enc["pixel_values"].shape[1:]:
                raise ValueError(
                    f"pixel_values have shape {list(pixel_values.shape[1:])} per image but this "
                    f"model expects {list(enc['pixel_values'].shape[1:])}"
                )
            enc["pixel_values"] = pixel_values
        ids = enc["input_ids"][0].tolist()
        items = self.model_cls.build_mm_items(self.hf_config, enc, ids, image_keys, video_keys)
        out = self._with_positions(ProcessedInputs(text, ids, items, lora=lora), enc)
        with self._recent_lock:
            self._recent.put(cache_key, out)  # shared read-only by the requests that hit it
        return out

    def _encode(self, text: str, kwargs: dict[str, Any], shortcut: bool, images_key: tuple):
        """The HF processor's outputs for text + media; prompts with images only take the placeholder
        expansion shortcut once it has learned their image sizes (multimodal/placeholder_expansion.py), and
        on that path pictures seen recently (images_key: device and content hashes) reuse the image
        processor's outputs: another question about the same picture skips its resize and normalisation."""
        expansion = self._expansion if shortcut else None
        image_outputs = lambda: self._recent_image_outputs(images_key, kwargs)  # noqa: E731
        if expansion is not None:
            sizes = [im.size for im in kwargs["images"]]
            runs = expansion.expansions_for(sizes)
            if runs is not None:
                enc = expansion.encode(text, runs, image_outputs)
                if enc is not None:
                    return enc
        enc = self._streams.run(lambda: self.processor(text=text, return_tensors="pt", **kwargs))
        if expansion is not None:
            expansion.learn(sizes, enc, text, image_outputs)
        return enc

    def _recent_image_outputs(self, key: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        with self._recent_lock:
            out = self._recent_images.get(key)
            if out is not None:
                return out  # shared read-only, as the ProcessedInputs of exact repeats are
        out = self._streams.run(lambda: self._image_outputs(kwargs))
        with self._recent_lock:
            self._recent_images.put(key, out)
        return out

    def _image_outputs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        extra = {"device": kwargs["device"]} if "device" in kwargs else {}
        image_processor = self.processor.image_processor
        images = kwargs["images"]
        if TorchvisionBackend is not None and isinstance(image_processor, TorchvisionBackend):
            images = [chw_uint8(im) for im in images]
        return dict(image_processor(images, return_tensors="pt", **extra))

    def _with_positions(self, out: ProcessedInputs, enc) -> ProcessedInputs:
        """Families with positions of their own (M-RoPE, CogVLM): every prompt, text-only too (enc None), gets
        them."""
        if self.model_cls.family.mrope or self.model_cls.family.own_positions:
            out.prompt_positions, out.position_delta = self.model_cls.prompt_positions(
                self.hf_config, enc, out.prompt_token_ids
            )
        return out

    def _check_placeholders(self, text: str, num_images: int, num_videos: int) -> None:
        if not self.placeholder_in_prompt:
            if num_videos or num_images > 1:
                raise ValueError(
                    f"this model takes at most one image per prompt, got {num_images} "
                    f"image(s) and {num_videos} video(s)"
                )
            return
        found = text.count(self.image_token)
        if found != num_images:
            raise ValueError(
                f"the prompt has {found} {self.image_token} placeholder(s) "
                f"but {num_images} image(s) were given"
            )
        if num_videos and self.video_token is None:
            raise ValueError(f"model type {self.hf_config.model_type!r} does not take video input")
        found = text.count(self.video_token) if self.video_token else 0
        if found != num_videos:
            raise ValueError(
                f"the prompt has {found} {self.video_token} placeholder(s) "
                f"but {num_videos} video(s) were given"
            )

    def _load_videos(self, videos: list, num_frames: Any) -> list[np.ndarray]:
        return load_videos(videos, num_frames, self.media)

    def apply_chat_template(self, messages: list[dict]) -> dict[str, Any]:
        """OpenAI-style messages -> a prompt dict {"prompt", "images", "videos"} for process()
        (multimodal/chat_prompt.py)."""
        return chat_prompt(
            messages, self.processor, self.tokenizer, self.model_cls.family.encoder_decoder
        )


def chw_uint8(image: Image.Image) -> Image.Image | torch.Tensor:
    """An RGB picture as the uint8 [3, H, W] tensor a torchvision image processor makes of it, by PIL's band split:
    the processor's own conversion (permute + contiguous in torch) takes milliseconds on a busy CPU, this a tenth
    of one; the same values. Other modes stay pictures."""
    if image.mode != "RGB":
        return image
    return torch.from_numpy(np.stack([np.asarray(band) for band in image.split()]))
