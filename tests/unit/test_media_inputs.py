"""Media loading (mmserve.multimodal.inputs) and image hashing against real files and a local HTTP server."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import os
import socket
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from mmserve.multimodal import fetch
from mmserve.multimodal.fetch import is_public_address
from mmserve.multimodal.hashing import hash_bytes, hash_image
from mmserve.multimodal.inputs import (
    aload_image,
    aload_images,
    aload_video_bytes,
    load_image,
    load_images,
    load_video_bytes,
)
from mmserve.multimodal.media_limits import MediaConfig, MediaError

PRIVATE_OK = MediaConfig(allow_private_urls=True)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _pixels(img: Image.Image) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in p) for p in np.asarray(img).reshape(-1, 3)]


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but carries no pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


PIXELS = np.random.default_rng(0).integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
PICTURE = Image.fromarray(PIXELS)
PNG = _png(PICTURE)
BIG = b"\0" * (2 * 2**20)
SENT = {"endless": 0}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {"Content-Length": str(len(body))}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        if self.path == "/img.png":
            self._send(200, PNG, {"Content-Length": str(len(PNG)), "Content-Type": "image/png"})
        elif self.path == "/redirect":
            self._send(302, headers={"Location": "/img.png", "Content-Length": "0"})
        elif self.path == "/redirect-loop":
            self._send(302, headers={"Location": "/redirect-loop", "Content-Length": "0"})
        elif self.path == "/redirect-private":
            self._send(
                302, headers={"Location": f"http://127.0.0.2:{port}/img.png", "Content-Length": "0"}
            )
        elif self.path == "/host":
            self._send(200, self.headers["Host"].encode())
        elif self.path == "/big":
            self._send(200, BIG)
        elif self.path == "/endless":  # no Content-Length: only the streaming cap can stop it
            self._send(200, headers={"Content-Type": "application/octet-stream"})
            try:
                while SENT["endless"] < 256 * 2**20:
                    self.wfile.write(b"\0" * 65536)
                    SENT["endless"] += 65536
            except OSError:
                pass
        elif self.path == "/slow":
            time.sleep(0.6)
            self._send(200, PNG)
        elif self.path == "/drip":  # each read is quick, the whole body is not
            self._send(200, headers={"Content-Length": "1000"})
            try:
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:
                pass
        else:
            self._send(404, b"not found")


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def media_root(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "pic.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    return root


# ----------------------------------------------------------------------------- every source, one hash


def test_every_source_kind_gives_the_same_hash(media_root, server):
    torch = pytest.importorskip("torch")
    config = MediaConfig(allowed_local_media_path=str(media_root), allow_private_urls=True)
    sources = {
        "pil": PICTURE,
        "png bytes": PNG,
        "bytearray": bytearray(PNG),
        "memoryview": memoryview(PNG),
        "data uri": _data_uri(PNG),
        "path": media_root / "pic.png",
        "str path": str(media_root / "pic.png"),
        "relative path": "pic.png",
        "file url": (media_root / "pic.png").as_uri(),
        "array HWC": PIXELS,
        "array CHW": PIXELS.transpose(2, 0, 1).copy(),
        "tensor HWC": torch.from_numpy(PIXELS),
        "tensor CHW": torch.from_numpy(PIXELS).permute(2, 0, 1),
        "http url": f"{server}/img.png",
    }
    expected = hash_image(PICTURE)
    for name, source in sources.items():
        img = load_image(source, config)
        assert img.mode == "RGB" and img.size == (7, 5), name
        assert hash_image(img) == expected, name
    assert asyncio.run(aload_image(f"{server}/img.png", config)).tobytes() == PICTURE.tobytes()


def test_hash_depends_on_pixels_and_shape():
    flat = Image.frombytes("RGB", (6, 1), PIXELS[0, :6].tobytes())
    tall = Image.frombytes("RGB", (1, 6), PIXELS[0, :6].tobytes())
    assert hash_image(flat) != hash_image(tall)
    other = PIXELS.copy()
    other[0, 0, 0] ^= 1
    assert hash_image(Image.fromarray(other)) != hash_image(PICTURE)
    assert hash_bytes(b"abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


# ----------------------------------------------------------------------------- decoding and conversion


def test_modes_are_converted_to_rgb():
    rgba = Image.new("RGBA", (2, 1))
    rgba.putpixel((0, 0), (10, 20, 30, 255))
    rgba.putpixel((1, 0), (10, 20, 30, 0))  # fully transparent: composited on white
    assert _pixels(load_image(_png(rgba))) == [(10, 20, 30), (255, 255, 255)]
    assert _pixels(load_image(Image.new("L", (1, 1), 77))) == [(77, 77, 77)]
    assert _pixels(load_image(Image.new("LA", (1, 1), (77, 0)))) == [(255, 255, 255)]
    palette = Image.new("P", (1, 1))
    palette.putpalette([0, 0, 0, 200, 100, 50])
    palette.putpixel((0, 0), 1)
    assert _pixels(load_image(_png(palette))) == [(200, 100, 50)]
    palette.info["transparency"] = 1
    assert _pixels(load_image(_png(palette))) == [(255, 255, 255)]
    assert load_image(Image.new("CMYK", (1, 1), (0, 0, 0, 0))).getpixel((0, 0)) == (255, 255, 255)
    deep = Image.fromarray(np.array([[0x1234, 0xFF00]], dtype=np.uint16))
    assert [p[0] for p in _pixels(load_image(_png(deep)))] == [0x12, 0xFF]
    assert load_image(np.full((2, 2, 4), 9, np.uint8)).mode == "RGB"
    assert _pixels(load_image(np.full((2, 2, 1), 9, np.uint8)))[0] == (9, 9, 9)


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    buf = io.BytesIO()
    Image.new("RGB", (40, 20), (200, 10, 10)).save(buf, format="JPEG", exif=exif)
    assert load_image(buf.getvalue()).size == (20, 40)


@pytest.mark.parametrize(
    "data",
    [b"not an image", PNG[: len(PNG) // 2], b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"],
)
def test_undecodable_bytes(data):
    with pytest.raises(MediaError, match="image: .*cannot be decoded as an image"):
        load_image(data)


def test_bad_arrays():
    with pytest.raises(MediaError, match="float32"):
        load_image(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(MediaError, match="shape"):
        load_image(np.zeros((4, 4, 5, 2), np.uint8))
    with pytest.raises(MediaError, match="unsupported image source"):
        load_image(12345)


def test_pixel_cap_checked_before_decoding():
    small = MediaConfig(max_image_pixels=50)
    for source in (
        _png(Image.new("RGB", (10, 10))),
        np.zeros((10, 10, 3), np.uint8),
        Image.new("RGB", (10, 10)),
    ):
        with pytest.raises(MediaError, match="max_image_pixels=50"):
            load_image(source, small)
    # headers only: decoding these would need gigabytes, so passing means the header was checked first
    with pytest.raises(MediaError, match="max_image_pixels"):
        load_image(_png_header(9000, 9000))
    with pytest.raises(MediaError, match="too large|max_image_pixels"):
        load_image(_png_header(30000, 30000))


def test_aspect_ratio_checked_before_decoding():
    """A 400000x1 picture is 1.2 KB as a PNG and under the pixel cap, but a processor that scales its short edge
    to 336 px would make 135 GB of it: refused from the header, before any pixel is decoded or resized."""
    for source in (
        _png_header(400000, 1),
        _png_header(1, 400000),
        np.zeros((1, 300, 3), np.uint8),
        Image.new("RGB", (201, 1)),
    ):
        with pytest.raises(MediaError, match="aspect ratio above max_image_aspect_ratio=200"):
            load_image(source)
    assert load_image(Image.new("RGB", (200, 1))).size == (200, 1)
    with pytest.raises(MediaError, match="max_image_aspect_ratio=3"):
        load_image(Image.new("RGB", (40, 10)), MediaConfig(max_image_aspect_ratio=3))
    for bad in (0.5, float("nan"), float("inf"), "2"):
        with pytest.raises(ValueError, match="max_image_aspect_ratio"):
            MediaConfig(max_image_aspect_ratio=bad)


def test_byte_cap_on_raw_bytes_and_data_uris():
    config = MediaConfig(max_media_bytes=len(PNG) - 1)
    for source in (PNG, _data_uri(PNG)):
        with pytest.raises(MediaError, match="max_media_bytes"):
            load_image(source, config)


def test_data_uris():
    with pytest.raises(MediaError, match="invalid base64"):
        load_image("data:image/png;base64,!!!not-base64!!!")
    with pytest.raises(MediaError, match="media type"):
        load_image("data:text/plain;base64," + base64.b64encode(PNG).decode())
    with pytest.raises(MediaError, match="malformed"):
        load_image("data:image/png;base64")
    wrapped = _data_uri(PNG)[:40] + "\n" + _data_uri(PNG)[40:]  # line-wrapped base64 is tolerated
    assert hash_image(load_image(wrapped)) == hash_image(PICTURE)


def test_too_many_images_and_index_in_error():
    with pytest.raises(MediaError, match="max_images_per_request=2"):
        load_images([PNG] * 3, MediaConfig(max_images_per_request=2))
    with pytest.raises(MediaError, match=r"^images\[2\]: .*cannot be decoded"):
        load_images([PNG, PICTURE, b"garbage"])
    assert len(load_images([PNG, PICTURE])) == 2


def test_config_is_validated(tmp_path):
    with pytest.raises(ValueError, match="allowed_local_media_path"):
        MediaConfig(allowed_local_media_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="max_images_per_request"):
        MediaConfig(max_images_per_request=0)
    with pytest.raises(ValueError, match="fetch_timeout_s"):
        MediaConfig(fetch_timeout_s=0)


# ----------------------------------------------------------------------------- local files


def test_local_paths_refused_by_default(media_root):
    for source in (
        media_root / "pic.png",
        str(media_root / "pic.png"),
        (media_root / "pic.png").as_uri(),
    ):
        with pytest.raises(MediaError, match="local file paths are disabled"):
            load_image(source)


def test_local_path_escapes_refused(media_root, tmp_path):
    config = MediaConfig(allowed_local_media_path=str(media_root))
    (media_root / "link.png").symlink_to(tmp_path / "secret.png")
    escapes = [
        str(media_root / ".." / "secret.png"),
        "../secret.png",
        str(tmp_path / "secret.png"),
        "link.png",
        (media_root / "link.png").as_uri(),
        "file://" + str(media_root) + "/../secret.png",
    ]
    for source in escapes:
        with pytest.raises(MediaError, match="outside allowed_local_media_path"):
            load_image(source, config)
    with pytest.raises(MediaError, match="must not name a host"):
        load_image("file://example.com" + str(media_root / "pic.png"), config)
    with pytest.raises(MediaError, match="Is a directory"):
        load_image(str(media_root), config)
    with pytest.raises(MediaError, match="cannot open"):
        load_image("nope.png", config)
    with pytest.raises(MediaError, match="max_media_bytes"):
        load_image(
            "pic.png", MediaConfig(allowed_local_media_path=str(media_root), max_media_bytes=10)
        )


def test_fifo_does_not_hang(media_root):
    os.mkfifo(media_root / "pipe")
    with pytest.raises(MediaError, match="not a regular file"):
        load_image("pipe", MediaConfig(allowed_local_media_path=str(media_root)))


# ----------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "address, public",
    [
        ("8.8.8.8", True),
        ("2001:4860:4860::8888", True),
        ("64:ff9b::808:808", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("172.16.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("0.0.0.0", False),
        ("239.1.1.1", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),
        ("2002:7f00:1::1", False),
        ("64:ff9b::a00:1", False),
    ],
)
def test_is_public_address(address, public):
    assert is_public_address(ipaddress.ip_address(address)) is public


def test_private_urls_refused_by_default(server):
    port = server.rsplit(":", 1)[1]
    for url in (
        f"{server}/img.png",
        f"http://localhost:{port}/img.png",
        f"http://[::1]:{port}/img.png",
    ):
        with pytest.raises(MediaError, match="private/loopback"):
            load_image(url)
    with pytest.raises(MediaError, match="private/loopback"):
        asyncio.run(aload_image(f"{server}/img.png"))


def test_url_fetch_status_and_redirects(server):
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server}/missing", PRIVATE_OK)
    assert hash_image(load_image(f"{server}/redirect", PRIVATE_OK)) == hash_image(PICTURE)
    with pytest.raises(MediaError, match="too many redirects"):
        load_image(f"{server}/redirect-loop", PRIVATE_OK)
    with pytest.raises(MediaError, match="unsupported URL scheme"):
        load_image("ftp://127.0.0.1/img.png", PRIVATE_OK)


def test_every_redirect_hop_is_checked(server, monkeypatch):
    # pretend only 127.0.0.1 is public: the first hop passes, the redirect to 127.0.0.2 must not
    monkeypatch.setattr(fetch, "is_public_address", lambda ip: str(ip) == "127.0.0.1")
    assert load_image(f"{server}/redirect").size == (7, 5)
    with pytest.raises(MediaError, match="127.0.0.2"):
        load_image(f"{server}/redirect-private")


def test_connects_to_checked_addresses_only(server, monkeypatch):
    # multi.test "resolves" to a dead address first, then to the server: the fetch goes on with the second,
    # connecting to the checked address while the Host header keeps the name
    port = server.rsplit(":", 1)[1]
    real = socket.getaddrinfo
    fake = [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0)) for ip in ("127.0.0.2", "127.0.0.1")
    ]
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, *rest, **kw: fake if host == "multi.test" else real(host, *rest, **kw),
    )
    url, host = f"http://multi.test:{port}/host", f"multi.test:{port}".encode()
    assert load_video_bytes(url, PRIVATE_OK) == host
    assert asyncio.run(aload_video_bytes(url, PRIVATE_OK)) == host
    with pytest.raises(MediaError, match="127.0.0.2"):
        load_video_bytes(url)


def test_download_byte_cap(server):
    config = MediaConfig(allow_private_urls=True, max_media_bytes=2**20)
    with pytest.raises(MediaError, match="max_media_bytes"):
        load_video_bytes(f"{server}/big", config)
    SENT["endless"] = 0
    start = time.monotonic()
    with pytest.raises(MediaError, match="max_media_bytes"):
        load_video_bytes(
            f"{server}/endless", MediaConfig(allow_private_urls=True, max_media_bytes=256 * 1024)
        )
    assert (
        time.monotonic() - start < 5 and SENT["endless"] < 64 * 2**20
    )  # aborted, not read to the end
    assert load_video_bytes(f"{server}/big", PRIVATE_OK) == BIG


def test_download_timeouts(server):
    config = MediaConfig(allow_private_urls=True, fetch_timeout_s=0.3)
    for path in ("/slow", "/drip"):
        start = time.monotonic()
        with pytest.raises(MediaError, match="timed out"):
            load_image(f"{server}{path}", config)
        assert time.monotonic() - start < 1.5, path
        with pytest.raises(MediaError, match="timed out"):
            asyncio.run(aload_image(f"{server}{path}", config))


def test_connection_refused():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(MediaError, match="failed"):
        load_image(f"http://127.0.0.1:{port}/x.png", PRIVATE_OK)


# ----------------------------------------------------------------------------- async


def test_async_loading(server):
    async def main():
        images = await aload_images(
            [f"{server}/img.png", PNG, _data_uri(PNG), f"{server}/redirect"], PRIVATE_OK
        )
        assert {hash_image(img) for img in images} == {hash_image(PICTURE)}
        with pytest.raises(MediaError, match=r"^images\[1\]: .*HTTP 404"):
            await aload_images([PNG, f"{server}/missing"], PRIVATE_OK)
        with pytest.raises(MediaError, match="max_media_bytes"):
            await aload_video_bytes(
                f"{server}/endless", MediaConfig(allow_private_urls=True, max_media_bytes=65536)
            )
        with pytest.raises(MediaError, match="max_images_per_request"):
            await aload_images([PNG] * 17)

        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await aload_image(
            f"{server}/slow", PRIVATE_OK
        )  # the server stalls 0.6 s; the loop must keep running
        task.cancel()
        assert ticks >= 20

    asyncio.run(main())
