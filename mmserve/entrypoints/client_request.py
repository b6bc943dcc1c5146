"""The request `mmserve client` sends: its pictures or video loaded (client side), and the seeds' input tensors
per --model_type (PROTOCOL §5), LoRA tensors included."""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from mmserve.models.family import FamilySpec
from mmserve.models.registry import families


def client_families() -> dict[str, FamilySpec]:
    """--model_type name -> the family it sends requests for (each family's spec says how: `spec.client`)."""
    return {s.client.model_type: s for s in families() if s.client is not None}


class ClientError(Exception):
    """A failure reported on stderr; main() returns 1."""


# ---- media ---------------------------------------------------------------------------------


def load_image(source: str, timeout: float = 30.0) -> Image.Image:
    """Path, http(s) URL (fetched here) or data:image/...;base64 URI -> RGB image."""
    if source.startswith("http"):
        import httpx

        try:
            resp = httpx.get(source, follow_redirects=True, timeout=timeout)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            raise ClientError(f"cannot fetch image {source}: {e}") from None
        data = resp.content
    elif source.startswith("data:image/") and ";base64," in source:
        data = base64.b64decode(source.split(",", 1)[1])
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise ClientError(f"cannot read image {source}: {e}") from None
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except Exception as e:
        raise ClientError(f"cannot decode image {source[:80]}: {e}") from None


def load_video(path: str, num_frames: int) -> np.ndarray:
    """[F, H, W, 3] uint8 frames at the seed's indices: arange(0, total, total / num_frames)."""
    import av

    try:
        with av.open(path) as container:
            total = container.streams.video[0].frames
            if total <= 0:
                total = sum(1 for _ in container.decode(video=0))
                container.seek(0)
            wanted = set(np.arange(0, total, total / num_frames).astype(int).tolist())
            frames = [
                f.to_ndarray(format="rgb24")
                for i, f in enumerate(container.decode(video=0))
                if i in wanted
            ]
    except Exception as e:
        raise ClientError(f"cannot read video {path}: {e}") from None
    if not frames:
        raise ClientError(f"no frames decoded from {path}")
    return np.stack(frames)


def to_png_data_uri(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# ---- request -------------------------------------------------------------------------------


@dataclass
class Request:
    model_name: str
    tensors: list[tuple[str, np.ndarray]]  # in the seed's prepare_inputs order
    images: list[Image.Image] = field(default_factory=list)  # for image_url_input over HTTP
    has_video: bool = False


def _preprocessed(args: argparse.Namespace, images: list[Image.Image]) -> np.ndarray:
    """The seed's preprocessing: pixel_values of the checkpoint in --hf_model_dir as its family's processor
    prepares them (the HF processor, or the family's own, e.g. VILA's), FP16 [1, N, 3, H, W]."""
    if not Path(args.hf_model_dir).exists():
        raise ClientError(f"--hf_model_dir {args.hf_model_dir} does not exist")
    from mmserve.models.loader import load_hf_config
    from mmserve.models.registry import get_model_class

    config = load_hf_config(args.hf_model_dir)
    processor = get_model_class(config).build_processor(args.hf_model_dir, config)
    image_processor = getattr(processor, "image_processor", processor)
    pixels = image_processor(images, return_tensors="pt")["pixel_values"]
    if pixels.dim() != 4:
        raise ClientError(
            f"the processor in {args.hf_model_dir} gives pixel_values of shape {list(pixels.shape)}, "
            "not [N, 3, H, W]; send raw images instead (leave out --hf_model_dir)"
        )
    return pixels.unsqueeze(0).numpy().astype(np.float16)


def _raw_pixels(images: list[Image.Image]) -> np.ndarray | None:
    """Decoded RGB pixels [1, N, H, W, 3] uint8; None when the images differ in size (they cannot stack)."""
    arrays = [np.asarray(im, dtype=np.uint8) for im in images]
    if any(a.shape != arrays[0].shape for a in arrays):
        return None
    return np.stack(arrays)[None]


def _image_tensors(
    args: argparse.Namespace, images: list[Image.Image], video: np.ndarray | None
) -> list[tuple[str, np.ndarray]]:
    """The image/video tensor(s) the seed sends for --model_type."""
    if video is not None:
        return [("video_bytes_input", video[None])]
    if not images:
        return []
    kind = args.model_type
    fmt = client_families()[kind].client
    if fmt.padded_sizes:
        h, w = max(im.height for im in images), max(im.width for im in images)
        padded = np.zeros((len(images), h, w, 3), dtype=np.uint8)
        for i, im in enumerate(images):
            padded[i, : im.height, : im.width] = np.asarray(im)
        sizes = np.array([[[im.height, im.width] for im in images]], dtype=np.int64)
        return [("image_bytes_input", padded[None]), ("image_sizes_input", sizes)]
    if fmt.preprocessed and args.hf_model_dir is not None:
        return [("image_input", _preprocessed(args, images))]
    if fmt.preprocessed:
        print(
            f"[INFO] no --hf_model_dir: sending raw image_bytes_input for {kind} (the server preprocesses); "
            "the seed would download the hub processor and send image_input",
            file=sys.stderr,
        )
    pixels = _raw_pixels(images)
    if pixels is None:
        print(
            "[INFO] the images differ in size, so they cannot stack into one image_bytes_input tensor; "
            "sending them as image_url_input data URIs",
            file=sys.stderr,
        )
        uris = np.array([[to_png_data_uri(im).encode() for im in images]], dtype=np.object_)
        return [("image_url_input", uris)]
    return [("image_bytes_input", pixels)]


def build_request(args: argparse.Namespace) -> Request:
    video = None
    images: list[Image.Image] = []
    family = client_families()[args.model_type]
    if args.video is not None and family.client.video:
        if not args.video_num_frames or args.video_num_frames < 1:
            raise ClientError("--video needs --video_num_frames >= 1")
        video = load_video(args.video, args.video_num_frames)
    elif args.image:
        images = [load_image(s.strip(), args.timeout) for s in args.image.split(",") if s.strip()]
    text = args.text
    if family.client.resize is not None:
        images = [im.resize(family.client.resize) for im in images]
    prompt = family.prompt
    if prompt is not None and prompt.prepend_images and images and prompt.image_token not in text:
        text = prompt.image_token + text

    def scalar(value, dtype) -> np.ndarray:
        return np.array([[value]], dtype=dtype)

    tensors = [
        ("text_input", np.array([[text.encode("utf8")]], dtype=np.object_)),
        ("max_tokens", scalar(args.request_output_len, np.int32)),
        ("beam_width", scalar(args.beam_width, np.int32)),
        ("temperature", scalar(args.temperature, np.float32)),
        ("end_id", scalar(args.end_id, np.int32)),
        ("pad_id", scalar(args.pad_id, np.int32)),
        ("top_k", scalar(args.top_k, np.int32)),
        ("top_p", scalar(args.top_p, np.float32)),
        ("stream", scalar(args.streaming, bool)),
    ]
    if args.protocol == "grpc":
        tensors += _image_tensors(args, images, video)
    elif video is not None:
        raise ClientError(
            "--video needs --protocol grpc (the generate endpoint cannot carry video tensors)"
        )
    elif args.hf_model_dir is not None and family.client.preprocessed:
        print(
            "[INFO] --protocol http sends images as image_url_input data URIs; --hf_model_dir preprocessing "
            "applies to grpc only",
            file=sys.stderr,
        )
    if args.repetition_penalty is not None:
        tensors.append(("repetition_penalty", scalar(args.repetition_penalty, np.float32)))
    if args.presence_penalty is not None:
        tensors.append(("presence_penalty", scalar(args.presence_penalty, np.float32)))
    if args.prompt_table_extra_id is not None:
        if not 1 <= args.prompt_table_extra_id < 2**64:
            raise ClientError("--prompt_table_extra_id must be in [1, 2^64-1]")
        tensors.append(("prompt_table_extra_id", scalar(args.prompt_table_extra_id, np.uint64)))
    if args.lora_task_id is not None:
        if not 0 <= args.lora_task_id < 2**64:
            raise ClientError("--lora-task-id must be in [0, 2^64-1]")
        tensors.append(("lora_task_id", scalar(args.lora_task_id, np.uint64)))
    if args.lora_path is not None:
        if args.lora_task_id is None:
            raise ClientError(
                "--lora-path needs --lora-task-id (the id the adapter is cached under)"
            )
        tensors += _lora_tensors(args.lora_path)
    model = args.model_name or ("tensorrt_llm_bls" if args.use_bls else "ensemble")
    return Request(model, tensors, images, video is not None)


def _lora_tensors(path: str) -> list[tuple[str, np.ndarray]]:
    """lora_weights (FP16) and lora_config (INT32) from hf_lora_convert.py's files, with their batch dimension."""
    out = []
    for name, dtype in (("lora_weights", np.float16), ("lora_config", np.int32)):
        file = os.path.join(path, f"model.{name}.npy")
        if not os.path.isfile(file):
            raise ClientError(f"--lora-path: {file} not found")
        arr = np.load(file).astype(dtype)
        out.append((name, arr if arr.ndim == 3 else arr[None]))
    return out
