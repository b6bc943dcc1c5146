"""What `mmserve bench serve` sends: each sweep point's requests (synthetic pictures, or a `--dataset` file's), and
the warm-up requests that give the server every request shape of the timed points before any timing.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

from mmserve.bench.dataset import DatasetRequest, output_lens
from mmserve.bench.serve_config import ServeConfig
from mmserve.bench.workload import make_images

_MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp", "GIF": "image/gif"}


def picture_uri(data: bytes, mime: str) -> str:
    """Picture bytes as the data URI a request carries (every protocol sends pictures this way)."""
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def data_uri(image: Any) -> str:
    """A PIL image as a JPEG data URI."""
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return picture_uri(buf.getvalue(), "image/jpeg")


def file_uri(path: Any) -> str:
    """A picture file's own bytes (not re-encoded) as a data URI of its format."""
    from PIL import Image

    with Image.open(path) as im:
        mime = _MIME.get(im.format or "", f"image/{(im.format or 'jpeg').lower()}")
    with open(path, "rb") as f:
        return picture_uri(f.read(), mime)


@dataclass(frozen=True)
class ServeRequest:
    """One request: the user's text, its pictures as data URIs, and the tokens it asks for."""

    text: str
    image_uris: tuple[str, ...]
    output_len: int
    image_sizes: tuple[tuple[int, int], ...]  # (width, height) per picture

    @property
    def shape(self) -> tuple[Any, ...]:
        """What the server's work depends on: text, picture sizes, output length."""
        return (self.text, self.image_sizes, self.output_len)


def point_images(cfg: ServeConfig, index: int) -> list[Any]:
    """Sweep point `index`'s pictures: square noise, distinct per request and per point (one shared by the
    point's requests with same_image)."""
    n = cfg.num_requests if cfg.unique_images else 1
    images = make_images(n, cfg.image_size, seed=cfg.seed * 1_000_003 + index * 10_007)
    return images if cfg.unique_images else images * cfg.num_requests


def synthetic_requests(cfg: ServeConfig, text: str, index: int) -> list[ServeRequest]:
    """Sweep point `index`'s requests: `text` and one of `point_images` each."""
    images = point_images(cfg, index)
    encoded = {id(im): data_uri(im) for im in images}  # a shared picture is encoded once
    uris = [encoded[id(im)] for im in images]
    size = ((cfg.image_size, cfg.image_size),)
    return [ServeRequest(text, (u,), cfg.output_len, size) for u in uris]


def dataset_requests(
    requests: list[DatasetRequest], output_len: int | None, default_len: int
) -> list[ServeRequest]:
    """A dataset's requests, each picture sent as its file's bytes (every point sends these same requests)."""
    lens = output_lens(requests, output_len, default_len)
    uris: dict[Any, str] = {}
    out = []
    for r, n in zip(requests, lens, strict=True):
        for p in r.images:
            uris.setdefault(p, file_uri(p))
        out.append(ServeRequest(r.prompt, tuple(uris[p] for p in r.images), n, r.image_sizes))
    return out


def peak_concurrency(cfg: ServeConfig) -> int:
    """The most requests a point has in flight by design: its concurrency, or all of an infinite rate's."""
    peaks = [*cfg.concurrencies, *(cfg.num_requests for r in cfg.request_rates if math.isinf(r))]
    return min(cfg.num_requests, max(peaks, default=1))


def warmup_requests(cfg: ServeConfig, timed: list[ServeRequest]) -> list[ServeRequest]:
    """One request per distinct shape of the timed requests, then more of them up to max(--warmup, the sweep's
    peak concurrency), so the server meets its batch sizes too. Their pictures are fresh noise of the timed sizes
    (the same bytes would put the timed pictures in the server's caches). --warmup 0: none (a server warmed up
    by an earlier run stays warm)."""
    if cfg.warmup == 0:
        return []
    shapes: dict[tuple[Any, ...], ServeRequest] = {}
    for r in timed:
        shapes.setdefault(r.shape, r)
    count = max(cfg.warmup, len(shapes), peak_concurrency(cfg))
    models = list(shapes.values())
    out = []
    for i in range(count):
        model = models[i % len(models)]
        uris = tuple(
            data_uri(make_images(1, w, seed=cfg.seed + 999_983 + 7 * i + k, height=h)[0])
            for k, (w, h) in enumerate(model.image_sizes)
        )
        out.append(ServeRequest(model.text, uris, model.output_len, model.image_sizes))
    return out
