"""Deterministic synthetic test images (gradient + shapes per seed) and PNG / data-URI encoders."""

from __future__ import annotations

import base64
import io
import random

from PIL import Image, ImageDraw


def make_test_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """Return an RGB image of ``size`` (width, height) whose content depends only on ``seed``."""
    rng = random.Random(seed)
    w, h = size
    c0 = [rng.randrange(256) for _ in range(3)]
    c1 = [rng.randrange(256) for _ in range(3)]
    horizontal = rng.random() < 0.5
    img = Image.new("RGB", (w, h))
    px = img.load()
    for y in range(h):
        for x in range(w):
            t = x / max(w - 1, 1) if horizontal else y / max(h - 1, 1)
            px[x, y] = tuple(int(a + (b - a) * t) for a, b in zip(c0, c1))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 4)):
        x0, x1 = sorted(rng.randrange(w) for _ in range(2))
        y0, y1 = sorted(rng.randrange(h) for _ in range(2))
        box = (x0, y0, x1 + 2, y1 + 2)
        fill = tuple(rng.randrange(256) for _ in range(3))
        kind = rng.randrange(3)
        if kind == 0:
            draw.rectangle(box, fill=fill)
        elif kind == 1:
            draw.ellipse(box, fill=fill)
        else:
            draw.line(box, fill=fill, width=rng.randint(1, 3))
    return img


def image_to_png_bytes(img: Image.Image) -> bytes:
    """Encode ``img`` as PNG (lossless, so decoding gives back the exact pixels)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_to_data_uri(img: Image.Image, fmt: str = "png") -> str:
    """Encode ``img`` as a ``data:image/<fmt>;base64,...`` URI (fmt: png, jpeg, webp, ...)."""
    fmt = fmt.lower()
    pil_fmt = "JPEG" if fmt in ("jpg", "jpeg") else fmt.upper()
    mime = "jpeg" if fmt in ("jpg", "jpeg") else fmt
    buf = io.BytesIO()
    img.save(buf, format=pil_fmt)
    return f"data:image/{mime};base64,{base64.b64encode(buf.getvalue()).decode('ascii')}"
