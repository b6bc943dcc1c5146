"""User media (PIL image, array, bytes, data URI, path, file:// or http(s) URL) -> checked RGB images or video bytes.

MediaConfig holds the limits; one set of policy checks serves the sync and the async loaders."""

from __future__ import annotations

import asyncio
import base64
import functools
import io
import ipaddress
import os
import re
import socket
import stat
import sys
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from PIL import Image, ImageOps

# Pillow decoders accepted for user bytes; the rest stay off (EPS, for one, runs Ghostscript).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
MAX_REDIRECTS = 5
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


@dataclass(frozen=True)
class MediaConfig:
    """Limits on user-supplied media. Secure by default: no local files, no private-network URLs."""

    allow_private_urls: bool = False  # allow URLs whose host resolves to non-public addresses
    allowed_local_media_path: str | None = (
        None  # paths, file:// URLs allowed only under this dir (relative: in it)
    )
    fetch_timeout_s: float = 10.0  # wall-clock budget of one download, redirects included
    max_media_bytes: int = 32 * 2**20  # encoded size of one item (download, data URI, bytes, file)
    max_image_pixels: int = 64 * 2**20  # width * height of one image or video frame
    # long edge / short edge of one image or video frame. Processors that scale the short edge to a fixed size
    # (CLIP's, Nougat's) turn a picture of ratio r into about r square pictures, whatever its own pixel count:
    # at 200 no family's resize makes more than ~1.4x max_image_pixels (Nougat, 672 px short edge)
    max_image_aspect_ratio: float = 200.0
    max_images_per_request: int = 16
    max_video_frames: int = 64
    header_font_path: str | None = (
        None  # TrueType font Pix2Struct VQA models (Deplot) read questions in
    )

    def __post_init__(self) -> None:
        path = self.allowed_local_media_path
        if path is not None and not os.path.isdir(path):
            raise ValueError(
                f"allowed_local_media_path must be an existing directory, got {path!r}"
            )
        if self.header_font_path is not None and not os.path.isfile(self.header_font_path):
            raise ValueError(
                f"header_font_path must be an existing font file, got {self.header_font_path!r}"
            )
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        ratio = self.max_image_aspect_ratio
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not 1.0 <= ratio < float("inf")
        ):
            raise ValueError(f"max_image_aspect_ratio must be a finite number >= 1, got {ratio!r}")
        for name in (
            "max_media_bytes",
            "max_image_pixels",
            "max_images_per_request",
            "max_video_frames",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class MediaError(ValueError):
    """A media item was refused or could not be decoded; the message starts with the field name."""


def _error(field: str, message: str) -> MediaError:
    return MediaError(f"{field}: {message}")


def _check_size(nbytes: int, config: MediaConfig, field: str) -> None:
    if nbytes > config.max_media_bytes:
        raise _error(
            field,
            f"item is larger than max_media_bytes={config.max_media_bytes} ({nbytes} bytes or more)",
        )


def check_picture_size(
    width: int, height: int, config: MediaConfig, field: str, what: str = "image"
) -> None:
    """Every image and video frame passes here before any resizing: its pixels and its aspect ratio, which bounds
    what the family's processor makes of it."""
    if width * height > config.max_image_pixels:
        raise _error(
            field,
            f"{what} is {width}x{height} pixels, above max_image_pixels={config.max_image_pixels}",
        )
    if max(width, height) > config.max_image_aspect_ratio * max(min(width, height), 1):
        raise _error(
            field,
            f"{what} is {width}x{height} pixels, an aspect ratio above "
            f"max_image_aspect_ratio={config.max_image_aspect_ratio:g}",
        )


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor can exist unless torch was imported
    return torch is not None and isinstance(obj, torch.Tensor)


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for globally routable unicast addresses, looking inside IPv4-mapped/6to4/Teredo/NAT64 forms."""
    if ip.version == 6 and ip in _NAT64:
        return is_public_address(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    embedded = ip.version == 6 and (
        ip.ipv4_mapped or ip.sixtofour or (ip.teredo or (None, None))[1]
    )
    if embedded and not is_public_address(embedded):
        return False
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


class _Remote(str):
    """An http(s) URL still to download."""


def _resolve(
    source: Any, config: MediaConfig, field: str, kind: str
) -> Image.Image | np.ndarray | bytes | _Remote:
    """Everything short of the network: dispatch on the source's type, read files, decode data URIs."""
    if isinstance(source, (Image.Image, np.ndarray)) or _is_tensor(source):
        if kind != "image":
            raise _error(
                field,
                f"expected a {kind} path, URL, data URI or bytes, got {type(source).__name__}",
            )
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        _check_size(memoryview(source).nbytes, config, field)
        return bytes(source)
    source = os.fspath(source) if isinstance(source, os.PathLike) else source
    if not isinstance(source, str):
        raise _error(field, f"unsupported {kind} source of type {type(source).__name__}")
    lowered = source[:8].lower()
    if lowered.startswith("data:"):
        return _decode_data_uri(source, kind, config, field)
    if lowered.startswith(("http://", "https://")):
        return _Remote(source)
    if lowered.startswith("file:"):
        parts = urllib.parse.urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise _error(field, f"file:// URLs must not name a host, got {parts.netloc!r}")
        return _read_local(urllib.parse.unquote(parts.path), config, field)
    if _SCHEME.match(source):
        raise _error(
            field, f"unsupported URL scheme in {source!r:.120} (use http, https, file or data)"
        )
    return _read_local(source, config, field)


def _read_local(path: str, config: MediaConfig, field: str) -> bytes:
    """Read a file under allowed_local_media_path; relative paths are taken relative to that directory."""
    if config.allowed_local_media_path is None:
        raise _error(
            field,
            "local file paths are disabled; set allowed_local_media_path to allow a directory",
        )
    root = os.path.realpath(config.allowed_local_media_path)
    try:
        target = os.path.realpath(
            os.path.join(root, path)
        )  # follows symlinks, so links out are caught too
    except (OSError, ValueError) as exc:
        raise _error(field, f"invalid path {path!r:.120}") from exc
    if os.path.commonpath([root, target]) != root:
        raise _error(field, f"path {path!r:.120} is outside allowed_local_media_path")
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
        raise _error(field, f"cannot open {path!r:.120}: {exc.strerror}") from exc
    with file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise _error(field, f"{path!r:.120} is not a regular file")
        _check_size(info.st_size, config, field)
        data = file.read(config.max_media_bytes + 1)
    _check_size(len(data), config, field)
    return data


def _decode_data_uri(uri: str, kind: str, config: MediaConfig, field: str) -> bytes:
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise _error(field, "malformed data URI: no ',' before the payload")
    mime, *params = [part.strip().lower() for part in header.split(";")]
    if not mime.startswith(kind + "/"):
        raise _error(field, f"data URI media type must be {kind}/*, got {mime or 'text/plain'!r}")
    if "base64" in params:
        _check_size(
            len(payload) // 4 * 3, config, field
        )  # refuse before decoding: 4 chars carry 3 bytes
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except ValueError as exc:  # binascii.Error, or non-ASCII characters
            raise _error(field, "invalid base64 in data URI") from exc
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    _check_size(len(data), config, field)
    return data


class _Download:
    """Policy of one URL download, shared by the sync and async clients. Each hop's host is resolved and
    every address checked; connections go to checked addresses only (Host header and TLS SNI keep the
    name), so a second DNS answer cannot slip in between."""

    def __init__(self, url: str, config: MediaConfig, field: str):
        self.config, self.field = config, field
        self.url = self._parse(url)
        self.redirects, self.body = 0, bytearray()
        self.addresses: list[str] = []  # checked addresses of self.url's host not tried yet
        self.deadline = time.monotonic() + config.fetch_timeout_s

    def _parse(self, url: str) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError, TypeError) as exc:
            raise _error(self.field, f"invalid URL {str(url)!r:.120}") from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise _error(
                self.field, f"only http(s) URLs with a host can be fetched, got {str(url)!r:.120}"
            )
        return parsed

    def next_request(self) -> dict[str, Any]:
        """Keyword arguments for client.stream aimed at the next checked address (may block in getaddrinfo)."""
        host = self.url.raw_host.decode("ascii")
        if not self.addresses:
            try:
                infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as exc:
                raise _error(self.field, f"cannot resolve host {host!r}") from exc
            addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
            refused = [address for address in addresses if not is_public_address(address)]
            if refused and not self.config.allow_private_urls:
                raise _error(
                    self.field,
                    f"URL host {host!r} resolves to {refused[0]}, a private/loopback/"
                    "link-local/reserved address; set allow_private_urls=True to allow it",
                )
            self.addresses = list(dict.fromkeys(str(address) for address in addresses))
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self.fail(TimeoutError())
        headers = {"Host": self.url.netloc.decode("ascii"), "Accept-Encoding": "identity"}
        return {
            "method": "GET",
            "url": self.url.copy_with(host=self.addresses.pop(0)),
            "headers": headers,
            "extensions": {"sni_hostname": host},
            "timeout": remaining,
        }

    def on_connect_error(self, exc: httpx.ConnectError) -> None:
        """Go on with the host's next checked address; raise when none is left."""
        if not self.addresses:
            raise self.fail(exc) from exc

    def on_response(self, response: httpx.Response) -> bool:
        """True when the response redirects (self.url moved on: request again); raises on errors."""
        if response.has_redirect_location:
            self.redirects += 1
            if self.redirects > MAX_REDIRECTS:
                raise _error(self.field, f"too many redirects (more than {MAX_REDIRECTS})")
            self.url = self._parse(str(self.url.join(response.headers["Location"])))
            self.addresses = []
            return True
        if not response.is_success:
            raise _error(
                self.field, f"GET {str(self.url):.120} returned HTTP {response.status_code}"
            )
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit():
            _check_size(int(declared), self.config, self.field)
        return False

    def feed(self, chunk: bytes) -> None:
        self.body += chunk
        _check_size(len(self.body), self.config, self.field)
        if time.monotonic() > self.deadline:  # per-read timeouts alone let a slow drip run forever
            raise self.fail(TimeoutError())

    def fail(self, exc: BaseException) -> MediaError:
        timed_out = isinstance(exc, (httpx.TimeoutException, TimeoutError))
        reason = (
            f"timed out after {self.config.fetch_timeout_s}s" if timed_out else f"failed: {exc}"
        )
        return _error(self.field, f"fetching {str(self.url):.120} {reason}")


@functools.cache
def _client_options() -> dict[str, Any]:
    # trust_env=False: a proxy taken from the environment would resolve hosts itself, past the address check
    return {"follow_redirects": False, "trust_env": False, "verify": httpx.create_ssl_context()}


def _download(url: str, config: MediaConfig, field: str) -> bytes:
    fetch = _Download(url, config, field)
    try:
        with httpx.Client(**_client_options()) as client:
            while True:
                try:
                    with client.stream(**fetch.next_request()) as response:
                        if fetch.on_response(response):
                            continue
                        for chunk in response.iter_bytes():
                            fetch.feed(chunk)
                        return bytes(fetch.body)
                except httpx.ConnectError as exc:
                    fetch.on_connect_error(exc)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise fetch.fail(exc) from exc


async def _adownload(url: str, config: MediaConfig, field: str) -> bytes:
    fetch = _Download(url, config, field)
    try:
        async with (
            asyncio.timeout(config.fetch_timeout_s),
            httpx.AsyncClient(**_client_options()) as client,
        ):
            while True:
                request = await asyncio.to_thread(fetch.next_request)  # getaddrinfo blocks
                try:
                    async with client.stream(**request) as response:
                        if fetch.on_response(response):
                            continue
                        async for chunk in response.aiter_bytes():
                            fetch.feed(chunk)
                        return bytes(fetch.body)
                except httpx.ConnectError as exc:
                    fetch.on_connect_error(exc)
    except (httpx.HTTPError, TimeoutError) as exc:
        raise fetch.fail(exc) from exc


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


def _finish(img: Image.Image, field: str) -> Image.Image:
    """Upright RGB copy; a lazily opened image gets its pixels decoded here."""
    try:
        return _to_rgb(ImageOps.exif_transpose(img))  # exif_transpose returns a new image
    except Exception as exc:  # decoders raise many exception types on corrupt input
        raise _error(field, "data cannot be decoded as an image") from exc


def _decode_image_bytes(data: bytes, config: MediaConfig, field: str) -> Image.Image:
    Image.init()  # registers every plugin (a no-op after the first call), so the filter below sees them all
    try:
        img = Image.open(
            io.BytesIO(data), formats=[name for name in IMAGE_FORMATS if name in Image.OPEN]
        )
    except Image.DecompressionBombError as exc:  # Pillow's own hard cap fires inside open()
        raise _error(
            field, f"image is too large ({exc}); max_image_pixels={config.max_image_pixels}"
        ) from exc
    except Exception as exc:
        raise _error(field, "data cannot be decoded as an image") from exc
    check_picture_size(
        img.width, img.height, config, field
    )  # open() read only the header: no pixels yet
    return _finish(img, field)


def _array_to_image(array: Any, config: MediaConfig, field: str) -> Image.Image:
    """HxW, HxWxC or CxHxW uint8 array/tensor with C in (1, 3, 4) -> RGB image."""
    if _is_tensor(array):
        array = array.detach().cpu()
    if str(array.dtype) not in ("uint8", "torch.uint8"):
        raise _error(field, f"image array must have dtype uint8, got {array.dtype}")
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
        raise _error(
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
        return _finish(item, field)
    return _array_to_image(item, config, field)


def _check_count(sources: Any, config: MediaConfig, field: str) -> None:
    if not isinstance(sources, (list, tuple)):
        raise _error(field, f"expected a list of images, got {type(sources).__name__}")
    if len(sources) > config.max_images_per_request:
        raise _error(
            field,
            f"{len(sources)} images, more than max_images_per_request={config.max_images_per_request}",
        )


def load_image(
    source: Any, config: MediaConfig = MediaConfig(), *, field: str = "image"
) -> Image.Image:
    """Any supported image source -> upright RGB PIL image. Raises MediaError naming `field`."""
    item = _resolve(source, config, field, "image")
    if isinstance(item, _Remote):
        item = _download(item, config, field)
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
    return _download(item, config, field) if isinstance(item, _Remote) else item


async def aload_image(
    source: Any, config: MediaConfig = MediaConfig(), *, field: str = "image"
) -> Image.Image:
    """load_image for servers: the download is async, file reads and decoding run in worker threads."""
    item = await asyncio.to_thread(_resolve, source, config, field, "image")
    if isinstance(item, _Remote):
        item = await _adownload(item, config, field)
    return await asyncio.to_thread(_to_image, item, config, field)


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
    return await _adownload(item, config, field) if isinstance(item, _Remote) else item
