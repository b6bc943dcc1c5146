"""User media (PIL image, array, bytes, data URI, path, file:// or http(s) URL) -> checked RGB images or video bytes.

The limits and their checks are media_limits.py's, downloads fetch.py's."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import stat
import sys
import urllib.parse
from typing import Any

import numpy as np
from PIL import ExifTags, Image, ImageOps

from mmserve.multimodal.fetch import adownload, download
from mmserve.multimodal.media_limits import (
    MediaConfig,
    check_media_bytes,
    check_picture_size,
    media_error,
)

# Pillow decoders accepted for user bytes; the rest stay off (EPS, for one, runs Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# the EXIF orientations ImageOps.exif_transpose turns or flips a picture for (1 and others leave it as it is)
_TURNED = frozenset(range(2, 9))


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist unless torch was imported
    return torch is not None and isinstance(obj, torch.Tensor)


class _Remote(str):
    """An http(s) URL still to download."""


def _resolve(
    source: Any, config: MediaConfig, field: str, kind: str
) -> Image.Image | np.ndarray | bytes | _Remote:
    """Everything short of the network: dispatch on the source's type, read files, decode data URIs."""
    if isinstance(source, (Image.Image, np.ndarray)) or _is_tensor(source):
        if kind != "image":
            raise media_error(
                field,
                f"expected a {kind} path, URL, data URI or bytes, got {type(source).__name__}",
            )
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        check_media_bytes(memoryview(source).nbytes, config, field)
        return bytes(source)
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    if not isinstance(source, str):
        raise media_error(field, f"unsupported {kind} source of type {type(source).__name__}")
    lowered = source[:8].lower()
    if lowered.startswith("data:"):
        return _decode_data_uri(source, kind, config, field)
    if lowered.startswith(("http://", "https://")):
        return _Remote(source)
    if lowered.startswith("file:"):
        parts = urllib.parse.urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise media_error(field, f"file:// URLs must not name a host, got {parts.netloc!r}")
        return _read_local(urllib.parse.unquote(parts.path), config, field)
    if _SCHEME.match(source):
        raise media_error(
            field, f"unsupported URL scheme in {source!r:.120} (use http, https, file or data)"
        )
    return _read_local(source, config, field)


def _read_local(path: str, config: MediaConfig, field: str) -> bytes:
    """Read a file under allowed_local_media_path; relative paths are taken relative to that directory, or to the
    working directory when it is the filesystem's root (every file allowed: the offline `LLM`'s default)."""
    if config.allowed_local_media_path is None:
        raise media_error(
            field,
            "local file paths are disabled; set allowed_local_media_path to allow a directory",
        )
    root = os.path.realpath(config.allowed_local_media_path)
    base = os.getcwd() if root == os.path.realpath(os.sep) else root
    try:
        # realpath follows symlinks, so links out are caught too
        target = os.path.realpath(os.path.join(base, path))
    except (OSError, ValueError) as exc:
        raise media_error(field, f"invalid path {path!r:.120}") from exc
    if os.path.commonpath([root, target]) != root:
        raise media_error(field, f"path {path!r:.120} is outside allowed_local_media_path")
    # O_NONBLOCK: opening a FIFO must not hang; O_NOFOLLOW: the last component cannot become a link after the check
    flags = (
        os.O_RDONLY
        | getattr(os, "O_NONBLOCK", 0)
        | getattr(os, "O_NOFOLLOW", 0)
        | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        file = open(target, "rb", opener=lambda name, _: os.open(name, flags))
    except OSError as exc:  # a directory lands here too
        raise media_error(field, f"cannot open {path!r:.120}: {exc.strerror}") from exc
    with file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise media_error(field, f"{path!r:.120} is not a regular file")
        check_media_bytes(info.st_size, config, field)
        data = file.read(config.max_media_bytes + 1)
    check_media_bytes(len(data), config, field)
    return data


def _decode_data_uri(uri: str, kind: str, config: MediaConfig, field: str) -> bytes:
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise media_error(field, "malformed data URI: no ',' before the payload")
    mime, *params = [part.strip().lower() for part in header.split(";")]
    if not mime.startswith(kind + "/"):
        raise media_error(
            field, f"data URI media type must be {kind}/*, got {mime or 'text/plain'!r}"
        )
    if "base64" in params:
        check_media_bytes(
            len(payload) // 4 * 3, config, field
        )  # refuse before decoding: 4 chars carry 3 bytes
        try:
            data = _b64decode(payload)
        except ValueError as exc:  # binascii.Error, or non-ASCII characters
            raise media_error(field, "invalid base64 in data URI") from exc
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    check_media_bytes(len(data), config, field)
    return data


def _b64decode(payload: str) -> bytes:
    """Strict base64, line breaks and spaces allowed; the payload is copied without them only when it has some."""
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:
        return base64.b64decode("".join(payload.split()), validate=True)


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB view of any mode; transparency is composited on white, 16-bit grey keeps its top 8 bits."""
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if img.mode.startswith("I;16"):
        return Image.fromarray((np.asarray(img) >> 8).astype(np.uint8)).convert("RGB")
    if img.mode in ("RGBA", "RGBa", "LA", "La", "PA"):
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def _finish(img: Image.Image, field: str, owned: bool) -> Image.Image:
    """Upright RGB image (ImageOps.exif_transpose's orientation rule); a lazily opened image gets its pixels
    decoded here. `owned`: `img` was opened here and may be turned in place; a caller's picture is never changed
    (it is copied when it must be turned, and returned as it is when it is upright RGB)."""
    try:
        if owned:
            ImageOps.exif_transpose(img, in_place=True)
        else:
            img.load()
            if img.getexif().get(ExifTags.Base.Orientation, 1) in _TURNED:
                img = ImageOps.exif_transpose(img)
        return _to_rgb(img)
    except Exception as exc:  # decoders raise many exception types on corrupt input
        raise media_error(field, "data cannot be decoded as an image") from exc


def _decode_image_bytes(data: bytes, config: MediaConfig, field: str) -> Image.Image:
    Image.init()  # registers every plugin (a no-op after the first call), so the filter below sees them all
    try:
        img = Image.open(
            io.BytesIO(data), formats=[name for name in IMAGE_FORMATS if name in Image.OPEN]
        )
    except Image.DecompressionBombError as exc:  # Pillow's own hard cap fires inside open()
        raise media_error(
            field, f"image is too large ({exc}); max_image_pixels={config.max_image_pixels}"
        ) from exc
    except Exception as exc:
        raise media_error(field, "data cannot be decoded as an image") from exc
    check_picture_size(
        img.width, img.height, config, field
    )  # open() read only the header: no pixels yet
    return _finish(img, field, owned=True)


def _array_to_image(array: Any, config: MediaConfig, field: str) -> Image.Image:
    """HxW, HxWxC or CxHxW uint8 array/tensor with C in (1, 3, 4) -> RGB image."""
    if _is_tensor(array):
        array = array.detach().cpu()
    if str(array.dtype) not in ("uint8", "torch.uint8"):
        raise media_error(field, f"image array must have dtype uint8, got {array.dtype}")
    array = np.asarray(array)
    if array.ndim == 3 and array.shape[-1] not in (1, 3, 4) and array.shape[0] in (1, 3, 4):
        array = array.transpose(1, 2, 0)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if (
        array.ndim not in (2, 3)
        or (array.ndim == 3 and array.shape[-1] not in (3, 4))
        or 0 in array.shape
    ):
        raise media_error(
            field,
            f"image array must be HxW, HxWxC or CxHxW with C in (1, 3, 4), got shape {array.shape}",
        )
    check_picture_size(array.shape[1], array.shape[0], config, field)
    return _to_rgb(Image.fromarray(np.ascontiguousarray(array)))


def _to_image(
    item: Image.Image | np.ndarray | bytes, config: MediaConfig, field: str
) -> Image.Image:
    if isinstance(item, bytes):
        return _decode_image_bytes(item, config, field)
    if isinstance(item, Image.Image):
        check_picture_size(item.width, item.height, config, field)
        return _finish(item, field, owned=False)
    return _array_to_image(item, config, field)


def _check_count(sources: Any, config: MediaConfig, field: str) -> None:
    if not isinstance(sources, (list, tuple)):
        raise media_error(field, f"expected a list of images, got {type(sources).__name__}")
    if len(sources) > config.max_images_per_request:
        raise media_error(
            field,
            f"{len(sources)} images, more than max_images_per_request={config.max_images_per_request}",
        )


def load_image(
    source: Any, config: MediaConfig = MediaConfig(), *, field: str = "image"
) -> Image.Image:
    """Any supported image source -> upright RGB PIL image. Raises MediaError naming `field`."""
    item = _resolve(source, config, field, "image")
    if isinstance(item, _Remote):
        item = download(item, config, field)
    return _to_image(item, config, field)


def load_images(
    sources: list, config: MediaConfig = MediaConfig(), *, field: str = "images"
) -> list[Image.Image]:
    """load_image over a list (at most max_images_per_request); errors name the index: 'images[2]: ...'."""
    _check_count(sources, config, field)
    return [load_image(source, config, field=f"{field}[{i}]") for i, source in enumerate(sources)]


def load_video_bytes(
    source: Any, config: MediaConfig = MediaConfig(), *, field: str = "video"
) -> bytes:
    """A video path, file:// or http(s) URL, data:video/... URI or raw bytes -> the encoded bytes."""
    item = _resolve(source, config, field, "video")
    return download(item, config, field) if isinstance(item, _Remote) else item


async def aload_image(
    source: Any, config: MediaConfig = MediaConfig(), *, field: str = "image"
) -> Image.Image:
    """load_image for servers: the download is async; file reads, data URIs and decoding run in a worker thread
    (one hop for a source that needs no download)."""
    item = await asyncio.to_thread(_load_local, source, config, field)
    if isinstance(item, _Remote):
        return await asyncio.to_thread(
            _to_image, await adownload(item, config, field), config, field
        )
    return item


def _load_local(source: Any, config: MediaConfig, field: str) -> Image.Image | _Remote:
    """load_image short of a download: the picture, or the URL still to fetch."""
    item = _resolve(source, config, field, "image")
    return item if isinstance(item, _Remote) else _to_image(item, config, field)


async def aload_images(
    sources: list, config: MediaConfig = MediaConfig(), *, field: str = "images"
) -> list[Image.Image]:
    """aload_image over a list, items fetched concurrently; the first failure cancels the rest."""
    _check_count(sources, config, field)
    tasks = [
        asyncio.ensure_future(aload_image(source, config, field=f"{field}[{i}]"))
        for i, source in enumerate(sources)
    ]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def aload_video_bytes(
    source: Any, config: MediaConfig = MediaConfig(), *, field: str = "video"
) -> bytes:
    """load_video_bytes with an async download."""
    item = await asyncio.to_thread(_resolve, source, config, field, "video")
    return await adownload(item, config, field) if isinstance(item, _Remote) else item
