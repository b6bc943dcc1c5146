"""Pictures come out of media loading (mmserve.multimodal.inputs) pixel for pixel as a copying
`ImageOps.exif_transpose` followed by the RGB conversion rules makes them, whatever the source (bytes, data URI,
a caller's PIL image, lazily opened or not), the EXIF orientation (1 to 8) and the mode; a caller's picture is
never changed."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import ExifTags, Image, ImageOps

from mmserve.multimodal.inputs import _to_rgb, aload_images, load_image, load_images

ORIENTATION = ExifTags.Base.Orientation


def _reference(img: Image.Image) -> Image.Image:
    """What loading made of a picture: exif_transpose's copy, then the module's RGB rules."""
    return _to_rgb(ImageOps.exif_transpose(img))


def _picture(mode: str, size: tuple[int, int] = (7, 4)) -> Image.Image:
    """An asymmetric picture in `mode` (every turn and flip changes it)."""
    w, h = size
    rgba = np.zeros((h, w, 4), np.uint8)
    rgba[..., 0] = np.arange(w)[None, :] * 30
    rgba[..., 1] = np.arange(h)[:, None] * 60
    rgba[..., 2] = 255 - rgba[..., 0]
    rgba[..., 3] = np.where((np.arange(w)[None, :] + np.arange(h)[:, None]) % 3 == 0, 0, 255)
    base = Image.fromarray(rgba, "RGBA")
    if mode == "P+transparency":
        img = base.convert("RGB").quantize(8)
        img.info["transparency"] = 0
        return img
    if mode == "P":
        return base.convert("RGB").quantize(8)
    if mode == "I;16":
        return Image.fromarray(
            (np.asarray(base.convert("L"), np.uint16) * 257 + 3).astype(np.uint16)
        )
    return base.convert(mode)


def _encoded(img: Image.Image, fmt: str, orientation: int | None) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[ORIENTATION] = orientation
    buf = io.BytesIO()
    kwargs = {"quality": 95} if fmt == "JPEG" else {}
    img.save(buf, format=fmt, exif=exif.tobytes(), **kwargs)
    return buf.getvalue()


def _same(got: Image.Image, want: Image.Image) -> None:
    assert (got.mode, got.size) == (want.mode, want.size)
    assert got.tobytes() == want.tobytes()


def _opened(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


@pytest.mark.parametrize("orientation", [None, 1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize(
    "fmt, mode", [("JPEG", "RGB"), ("JPEG", "CMYK"), ("JPEG", "L"), ("PNG", "RGBA")]
)
def test_every_orientation_every_source(fmt, mode, orientation):
    data = _encoded(_picture(mode), fmt, orientation)
    want = _reference(_opened(data))
    if orientation in (5, 6, 7, 8):
        assert want.size == (4, 7)  # turned a quarter
    if orientation in range(2, 9):
        assert want.getexif().get(ORIENTATION) is None
    uri = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    loaded = _opened(data)
    loaded.load()
    for source in (data, uri, _opened(data), loaded):
        got = load_image(source)
        _same(got, want)
        # an applied orientation is gone from the metadata, as exif_transpose leaves it
        assert got.getexif().get(ORIENTATION) == want.getexif().get(ORIENTATION)
    for got in [*asyncio.run(aload_images([uri])), *asyncio.run(aload_images([uri, data]))]:
        _same(got, want)


@pytest.mark.parametrize(
    "mode", ["RGB", "RGBA", "LA", "L", "1", "P", "P+transparency", "I;16", "I", "CMYK", "PA"]
)
@pytest.mark.parametrize("orientation", [None, 1, 6, 3])
def test_every_mode_converts_as_before(mode, orientation):
    picture = _picture(mode)
    if mode in ("CMYK", "PA", "I"):  # PNG keeps none of these: a caller's picture
        exif = picture.getexif()
        if orientation is not None:
            exif[ORIENTATION] = orientation
        _same(load_image(picture), _reference(picture))
        return
    data = _encoded(picture, "PNG", orientation)
    assert _opened(data).mode == picture.mode
    _same(load_image(data), _reference(_opened(data)))
    _same(load_image(_opened(data)), _reference(_opened(data)))


@pytest.mark.parametrize("orientation", [6, 2, 1, None])
def test_a_callers_picture_is_never_changed(orientation):
    data = _encoded(_picture("RGB"), "JPEG", orientation)
    for theirs in (_opened(data), _opened(data).convert("RGB")):
        if orientation is not None:
            theirs.getexif()[ORIENTATION] = orientation
        before = (theirs.size, theirs.tobytes(), theirs.getexif().get(ORIENTATION))
        (got,) = load_images([theirs])
        assert (theirs.size, theirs.tobytes(), theirs.getexif().get(ORIENTATION)) == before
        _same(got, _reference(theirs))
        if orientation in (2, 6):
            assert got is not theirs


def test_a_loaded_picture_loads_again_unchanged():
    """The server loads pictures twice (media, then preprocessing): the second pass changes nothing."""
    first = load_image(_encoded(_picture("RGB"), "JPEG", 6))
    again = load_image(first)
    _same(again, first)
    assert again.size == (4, 7)
