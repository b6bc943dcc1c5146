"""The limits on user media (MediaConfig) and the checks that every loader of pictures, videos and downloads shares;
MediaError names the field a refused item came in."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class MediaConfig:
    """Limits on user-supplied media. Secure by default: no local files, no private-network URLs."""

    allow_private_urls: bool = dataclasses.field(
        default=False,
        metadata=dict(
            help="allow media URLs whose host resolves to a non-public (private, loopback, link-local) "
            "address"
        ),
    )
    allowed_local_media_path: str | None = dataclasses.field(
        default=None,
        metadata=dict(
            help="local paths and file:// URLs are allowed only under this directory (relative paths: in "
            "it; /: every file); none: no local files"
        ),
    )
    fetch_timeout_s: float = dataclasses.field(
        default=10.0,
        metadata=dict(help="seconds one media download may take, redirects included"),
    )
    max_media_bytes: int = dataclasses.field(
        default=32 * 2**20,
        metadata=dict(
            help="encoded bytes of one image or video: download, data URI, tensor or file"
        ),
    )
    max_image_pixels: int = dataclasses.field(
        default=64 * 2**20,
        metadata=dict(
            help="width * height of one image or video frame (read from the header, before decoding)"
        ),
    )
    # Processors that scale the short edge to a fixed size (CLIP's, Nougat's) turn a picture of ratio r into
    # about r square pictures, whatever its own pixel count: at 200 no family's resize makes more than ~1.4x
    # max_image_pixels (Nougat, 672 px short edge)
    max_image_aspect_ratio: float = dataclasses.field(
        default=200.0,
        metadata=dict(help="long edge / short edge of one image or video frame"),
    )
    max_images_per_request: int = dataclasses.field(
        default=16, metadata=dict(help="images in one request")
    )
    max_video_frames: int = dataclasses.field(
        default=64, metadata=dict(help="frames sampled from one video")
    )
    header_font_path: str | None = dataclasses.field(
        default=None,
        metadata=dict(
            help="TrueType font Pix2Struct VQA models (Deplot) read the question in; none: Arial.TTF in "
            "the model directory or the hub cache, else Pillow's built-in font"
        ),
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


def media_error(field: str, message: str) -> MediaError:
    return MediaError(f"{field}: {message}")


def check_media_bytes(nbytes: int, config: MediaConfig, field: str) -> None:
    if nbytes > config.max_media_bytes:
        raise media_error(
            field,
            f"item is larger than max_media_bytes={config.max_media_bytes} ({nbytes} bytes or more)",
        )


def check_picture_size(
    width: int, height: int, config: MediaConfig, field: str, what: str = "image"
) -> None:
    """Every image and video frame passes here before any resizing: its pixels and its aspect ratio, which bounds
    what the family's processor makes of it."""
    if width * height > config.max_image_pixels:
        raise media_error(
            field,
            f"{what} is {width}x{height} pixels, above max_image_pixels={config.max_image_pixels}",
        )
    if max(width, height) > config.max_image_aspect_ratio * max(min(width, height), 1):
        raise media_error(
            field,
            f"{what} is {width}x{height} pixels, an aspect ratio above "
            f"max_image_aspect_ratio={config.max_image_aspect_ratio:g}",
        )
