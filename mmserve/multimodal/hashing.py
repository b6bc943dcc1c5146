"""Content hashes of media items: the keys for prefix (KV) cache and encoder cache reuse.

Hashes cover decoded content, so one picture sent as PNG bytes, data URI, path or array gets one key.
"""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image


def hash_bytes(data: bytes | bytearray | memoryview) -> str:
    """Plain sha256 hex digest of a buffer."""
    return hashlib.sha256(data).hexdigest()


def hash_image(img: Image.Image) -> str:
    """sha256 hex over mode, size, palette (if any) and raw pixels; format and metadata do not count."""
    digest = hashlib.sha256(b"image\0")
    digest.update(f"{img.mode}\0{img.width}x{img.height}\0".encode())
    if img.mode in ("P", "PA"):
        digest.update(bytes(img.getpalette() or []))
    digest.update(img.tobytes())
    return digest.hexdigest()


def hash_video(frames: np.ndarray | bytes | bytearray | memoryview) -> str:
    """sha256 hex of decoded frames (dtype, shape, values) or of encoded bytes.

    The two forms give different keys. For encoder-cache reuse hash the sampled frames: the same file
    sampled at a different num_frames is a different encoder input.
    """
    if isinstance(frames, (bytes, bytearray, memoryview)):
        digest = hashlib.sha256(b"video-bytes\0")
        digest.update(frames)
        return digest.hexdigest()
    array = np.ascontiguousarray(frames)
    digest = hashlib.sha256(b"video\0")
    digest.update(f"{array.dtype.str}\0{array.shape}\0".encode())
    digest.update(array.reshape(-1).view(np.uint8))  # buffer protocol: no copy of the frames
    return digest.hexdigest()
