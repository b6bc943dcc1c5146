"""InputProcessor: prompt text + media -> prompt token ids and MultiModalItems (placeholders expanded).

The family's own HF processor does resizing, normalisation and placeholder expansion, so our
token ids are exactly what `transformers` would feed the model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor

from mmserve.core.multimodal import MultiModalItem, ProcessedInputs
from mmserve.multimodal.hashing import hash_bytes, hash_image, hash_video
from mmserve.multimodal.inputs import load_images, load_video_bytes
from mmserve.multimodal.media_limits import MediaConfig, check_picture_size
from mmserve.multimodal.placeholder_expansion import PlaceholderExpansion
from mmserve.multimodal.prompt_table import prompt_table_items
from mmserve.multimodal.video import decode_video


class InputProcessor:
    """Prompt building for one checkpoint. `prompt` is a str or a dict with keys prompt | prompt_token_ids,
    images, videos, video_num_frames, image_ids (client-given identities, e.g. prompt_table_extra_id),
    pixel_values (already-preprocessed images [N, 3, H, W]), prompt_table (with prompt_token_ids: visual
    features [F, hidden] that ids from the vocabulary size on stand for, multimodal/prompt_table.py),
    decoder_prompt (encoder-decoder models: text the decoder's answer starts with, after its start token).

    The model class supplies the family-specific part: `build_mm_items(hf_config, enc, ids, image_keys,
    video_keys)` turns the HF processor's outputs into MultiModalItems, and, for M-RoPE families,
    `mrope_positions(hf_config, enc, ids)` gives the prompt's 3-axis positions.
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
        self._streams = threading.local()  # one CUDA stream per preprocessing thread
        self._recent = BoundedLRU(self.RECENT_INPUTS, self.RECENT_INPUTS_BYTES, _inputs_bytes)
        self._recent_images = BoundedLRU(
            self.RECENT_IMAGES,
            self.RECENT_IMAGES_BYTES,  # guarded by _recent_lock too
            lambda out: _tensor_bytes(out.values()),
        )
        self._recent_lock = threading.Lock()
        self.model_cls = model_cls
        self.media = media or MediaConfig()
        self.processor = AutoProcessor.from_pretrained(model_dir)
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

    def _decoder_ids(self, text: str, decoder_prompt: str) -> list[int]:
        """An encoder-decoder's decoder prompt: the family's start (with the text, for families whose prompt is the
        decoder's), then decoder_prompt's tokens."""
        ids = self.model_cls.decoder_prompt_ids(self.hf_config, self.tokenizer, text)
        if not decoder_prompt:
            return ids
        if not self.model_cls.family.encoder_reads_text and text.strip():
            raise ValueError(
                "decoder_prompt: this model's prompt already is the decoder's; give the answer's start "
                "in one of them"
            )
        return ids + self.tokenizer(decoder_prompt, add_special_tokens=False).input_ids

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
        images, videos = _as_list(prompt.get("images")), _as_list(prompt.get("videos"))
        pixel_values = prompt.get("pixel_values")
        if pixel_values is not None:
            if images:
                raise ValueError("give either images or pixel_values, not both")
            pixel_values = self._check_pixel_values(pixel_values)
            images = [None] * len(pixel_values)
        text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
        decoder_prompt = prompt.get("decoder_prompt") or ""
        if not isinstance(decoder_prompt, str):
            raise TypeError(f"decoder_prompt must be a string, got {type(decoder_prompt).__name__}")
        if decoder_prompt and not self.model_cls.family.encoder_decoder:
            raise ValueError(
                "decoder_prompt: only encoder-decoder models have a decoder prompt; put the text in the "
                "prompt"
            )
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
            return self._with_mrope(ProcessedInputs(text, list(token_ids), lora=lora), None)
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
            return self._with_mrope(ProcessedInputs(text, ids, lora=lora), None)
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
        if self.model_cls.family.encoder_decoder:  # the prompt is the decoder's
            if self.model_cls.family.encoder_reads_text:  # the processor's ids are the encoder's
                call = self.model_cls.call_processor
                enc = dict(self._on_stream(lambda: call(self.processor, text, kwargs)))
                if "input_ids" in enc:
                    enc["encoder_input_ids"] = enc["input_ids"]
                enc["encoder_text"] = text
            else:  # Nougat: the processor sees only the picture
                enc = dict(
                    self._recent_image_outputs((str(self.device), tuple(content_keys)), kwargs)
                )
            enc["input_ids"] = torch.tensor([self._decoder_ids(text, decoder_prompt)])
        else:
            enc = self._encode(
                text,
                kwargs,
                shortcut=pixel_values is None and not videos,
                images_key=(str(self.device), tuple(content_keys)),
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
        out = self._with_mrope(ProcessedInputs(text, ids, items, lora=lora), enc)
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
        enc = self._on_stream(lambda: self.processor(text=text, return_tensors="pt", **kwargs))
        if expansion is not None:
            expansion.learn(sizes, enc, text, image_outputs)
        return enc

    def _recent_image_outputs(self, key: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        with self._recent_lock:
            out = self._recent_images.get(key)
            if out is not None:
                return out  # shared read-only, as the ProcessedInputs of exact repeats are
        out = self._on_stream(lambda: self._image_outputs(kwargs))
        with self._recent_lock:
            self._recent_images.put(key, out)
        return out

    def _image_outputs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        extra = {"device": kwargs["device"]} if "device" in kwargs else {}
        return dict(self.processor.image_processor(kwargs["images"], return_tensors="pt", **extra))

    def _on_stream(self, fn):
        """fn() (an HF processor call) on this thread's own CUDA stream when preprocessing runs on the GPU.
        Its uploads from pageable memory synchronize their stream; on the engine's stream they would wait
        behind every step already queued there (with async scheduling, always one), stalling each request's
        preprocessing by a step."""
        if self.device is None:
            return fn()
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            enc = fn()
            for key, value in list(
                enc.items()
            ):  # sizes and grids to the host here, not later on the engine's
                if (
                    isinstance(value, torch.Tensor)
                    and value.is_cuda
                    and not value.is_floating_point()
                ):
                    enc[key] = value.cpu()  # waits for this thread's stream only
        stream.synchronize()
        engine_stream = torch.cuda.default_stream(self.device)
        for value in enc.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(engine_stream)  # freed only after the engine's reads of it
        return enc

    def _with_mrope(self, out: ProcessedInputs, enc) -> ProcessedInputs:
        """M-RoPE families: every prompt, text-only too (enc None), gets its [3, P] positions."""
        if self.model_cls.family.mrope:
            out.mrope_positions, out.mrope_delta = self.model_cls.mrope_positions(
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

    def _load_videos(self, videos: list, num_frames: int) -> list[np.ndarray]:
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"video_num_frames must be a positive integer, got {num_frames!r}")
        out = []
        for i, v in enumerate(videos):
            field_name = f"videos[{i}]"
            if isinstance(v, np.ndarray):  # already decoded frames [F, H, W, 3]
                if v.ndim != 4 or v.shape[-1] != 3 or v.dtype != np.uint8:
                    raise ValueError(
                        f"{field_name}: decoded frames must be uint8 [F, H, W, 3], got "
                        f"{v.dtype} {list(v.shape)}"
                    )
                if not 1 <= len(v) <= self.media.max_video_frames:
                    raise ValueError(
                        f"{field_name}: {len(v)} frames, allowed 1 to "
                        f"max_video_frames={self.media.max_video_frames}"
                    )
                check_picture_size(v.shape[2], v.shape[1], self.media, field_name, "a video frame")
                out.append(v)
            else:
                out.append(
                    decode_video(
                        load_video_bytes(v, self.media, field=field_name),
                        num_frames,
                        self.media,
                        field=field_name,
                    )
                )
        return out

    @staticmethod
    def _check_pixel_values(pixel_values) -> torch.Tensor:
        pv = torch.as_tensor(pixel_values)
        if pv.dim() == 3:
            pv = pv.unsqueeze(0)
        if pv.dim() != 4 or pv.shape[1] != 3 or not pv.is_floating_point():
            raise ValueError(
                f"pixel_values must be a float tensor [num_images, 3, H, W], got "
                f"{pv.dtype} {list(pv.shape)}"
            )
        if not torch.isfinite(pv).all():
            raise ValueError("pixel_values contain NaN or infinite values")
        return pv.float()

    def apply_chat_template(self, messages: list[dict]) -> dict[str, Any]:
        """OpenAI-style messages -> a prompt dict {"prompt", "images", "videos"} for process().

        Content parts: text, image_url / image, video_url / video (URL, data URI, path, bytes or decoded
        frames), in order; the checkpoint's chat template places their placeholders. An encoder-decoder without
        a chat template takes one user message: its text is the prompt, its picture the image.
        """
        hf_messages: list[dict] = []
        media: dict[str, list[Any]] = {"images": [], "videos": []}
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] needs a 'role'")
            content = m.get("content", "")
            if isinstance(content, str):
                hf_messages.append(
                    {"role": m["role"], "content": [{"type": "text", "text": content}]}
                )
                continue
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif kind in _MEDIA_PARTS:
                    modality, key = _MEDIA_PARTS[kind]
                    src = part.get(kind)
                    media[key].append(src["url"] if isinstance(src, dict) else src)
                    parts.append({"type": modality})
                else:
                    raise ValueError(f"messages[{i}]: unsupported content part type {kind!r}")
            hf_messages.append({"role": m["role"], "content": parts})
        # some processors drop the template their tokenizer carries (Fuyu's): use the tokenizer's then
        owner = self.processor if getattr(self.processor, "chat_template", None) else self.tokenizer
        if not getattr(owner, "chat_template", None) and self.model_cls.family.encoder_decoder:
            # encoder-decoders (Deplot, Nougat, BLIP-2 T5) have no chat format: one user turn is the prompt
            if len(hf_messages) != 1 or hf_messages[0]["role"] != "user":
                raise ValueError(
                    "messages: this model takes one user message (its text and picture), got roles "
                    f"{[m['role'] for m in hf_messages]}"
                )
            text = "\n".join(p["text"] for p in hf_messages[0]["content"] if p["type"] == "text")
            return {"prompt": text, **{k: v for k, v in media.items() if v}}
        if not getattr(owner, "chat_template", None):
            raise ValueError(
                "this model has no chat template: send a plain prompt (e.g. /v1/completions)"
            )
        prompt = owner.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        return {"prompt": prompt, **{k: v for k, v in media.items() if v}}


# chat content part type -> (the HF chat template's part type, prompt dict key)
_MEDIA_PARTS = {
    "image_url": ("image", "images"),
    "image": ("image", "images"),
    "video_url": ("video", "videos"),
    "video": ("video", "videos"),
}


class BoundedLRU:
    """An LRU cache of at most `max_entries` entries and `max_bytes` bytes, as `size_of(value)` counts them (a value
    larger than max_bytes is not kept). Not locked: InputProcessor holds its _recent_lock around every call."""

    def __init__(self, max_entries: int, max_bytes: int, size_of: Callable[[Any], int]) -> None:
        self.max_entries, self.max_bytes, self._size_of = max_entries, max_bytes, size_of
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = (
            OrderedDict()
        )  # least recently used first
        self.nbytes = 0

    def get(self, key: Hashable) -> Any | None:
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def put(self, key: Hashable, value: Any) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        size = self._size_of(value)
        if size > self.max_bytes:
            return
        self._entries[key] = (value, size)
        self.nbytes += size
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.nbytes -= dropped

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)


def _tensor_bytes(values) -> int:
    return sum(v.nbytes for v in values if isinstance(v, torch.Tensor))


def _inputs_bytes(inputs: ProcessedInputs) -> int:
    """What a ProcessedInputs holds: its encoder inputs, M-RoPE positions and prompt ids (a list of Python ints:
    a pointer and an int object each)."""
    n = 40 * len(inputs.prompt_token_ids) + sum(
        _tensor_bytes(m.data.values()) for m in inputs.mm_items
    )
    return n + (inputs.mrope_positions.nbytes if inputs.mrope_positions is not None else 0)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
