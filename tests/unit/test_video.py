"""Video decoding and frame sampling (mmserve.multimodal.video) on small videos encoded with PyAV."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
from PIL import Image

from mmserve.multimodal import video
from mmserve.multimodal.hashing import hash_video
from mmserve.multimodal.inputs import load_video_bytes
from mmserve.multimodal.media_limits import MediaConfig, MediaError
from mmserve.multimodal.video import decode_video, sample_frame_indices

# distinct solid colours, far apart so lossy coding cannot confuse them
COLORS = np.array(
    [(r, g, b) for r in (0, 128, 255) for g in (0, 255) for b in (0, 128, 255)], dtype=np.uint8
)


def _encode(colors: np.ndarray, container: str = "mp4", size: int = 32) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.bit_rate = 2_000_000
        for color in colors:
            frame = av.VideoFrame.from_ndarray(
                np.broadcast_to(color, (size, size, 3)).copy(), format="rgb24"
            )
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return buf.getvalue()


def _color_indices(frames: np.ndarray) -> list[int]:
    """Index in COLORS of each frame's mean colour."""
    means = frames.reshape(len(frames), -1, 3).mean(axis=1)
    return [int(np.argmin(((COLORS.astype(float) - mean) ** 2).sum(axis=1))) for mean in means]


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return _encode(COLORS)


def test_sample_frame_indices():
    assert sample_frame_indices(18, 4).tolist() == [0, 6, 11, 17]
    assert sample_frame_indices(18, 1).tolist() == [0]
    assert sample_frame_indices(3, 5).tolist() == [0, 0, 1, 2, 2]


@pytest.mark.parametrize(
    "container", ["mp4", "matroska", "mpegts"]
)  # mp4 stores a frame count, the others not
def test_uniform_sampling_picks_the_right_frames(container):
    data = _encode(COLORS, container)
    frames = decode_video(data, 4, MediaConfig())
    assert frames.shape == (4, 32, 32, 3) and frames.dtype == np.uint8
    expected = np.linspace(0, len(COLORS) - 1, 4).round().astype(int).tolist()
    assert _color_indices(frames) == expected
    assert _color_indices(decode_video(data, len(COLORS), MediaConfig())) == list(
        range(len(COLORS))
    )


@pytest.mark.parametrize("wrong_count", [5, 50])
def test_wrong_container_frame_count_is_corrected(mp4, monkeypatch, wrong_count):
    monkeypatch.setattr(video, "_frame_count", lambda *args: wrong_count)
    assert _color_indices(decode_video(mp4, 4)) == sample_frame_indices(len(COLORS), 4).tolist()


def test_short_video_repeats_frames():
    frames = decode_video(_encode(COLORS[:3]), 5)
    assert _color_indices(frames) == [0, 0, 1, 2, 2]


@pytest.mark.parametrize("data", [b"", b"garbage" * 100, _encode(COLORS[:2])[:200]])
def test_undecodable_bytes(data):
    with pytest.raises(MediaError, match="cannot be decoded as a video"):
        decode_video(data, 2)


@pytest.mark.parametrize(
    "data",
    [
        b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nhttp://127.0.0.1:9/x.ts\n#EXT-X-ENDLIST\n",
        b"ffconcat version 1.0\nfile /etc/hostname\n",
    ],
)
def test_playlist_formats_refused(data):
    with pytest.raises(MediaError, match="cannot be decoded as a video"):
        decode_video(data, 1)


def test_limits(mp4):
    for bad in (0, -1, 65, True, 2.0):
        with pytest.raises(MediaError, match="num_frames"):
            decode_video(mp4, bad)
    assert len(decode_video(mp4, 8, MediaConfig(max_video_frames=8))) == 8
    with pytest.raises(MediaError, match="max_image_pixels"):
        decode_video(mp4, 2, MediaConfig(max_image_pixels=32 * 32 - 1))
    with pytest.raises(MediaError, match="max_media_bytes"):
        decode_video(mp4, 2, MediaConfig(max_media_bytes=len(mp4) - 1))


def test_load_video_bytes(mp4, tmp_path):
    (tmp_path / "clip.mp4").write_bytes(mp4)
    config = MediaConfig(allowed_local_media_path=str(tmp_path))
    uri = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    for source in (
        mp4,
        bytearray(mp4),
        uri,
        "clip.mp4",
        tmp_path / "clip.mp4",
        (tmp_path / "clip.mp4").as_uri(),
    ):
        assert load_video_bytes(source, config) == mp4
    with pytest.raises(MediaError, match="media type must be video"):
        load_video_bytes("data:image/png;base64," + base64.b64encode(mp4).decode())
    with pytest.raises(MediaError, match="video path, URL"):
        load_video_bytes(Image.new("RGB", (2, 2)))
    with pytest.raises(MediaError, match="local file paths are disabled"):
        load_video_bytes("clip.mp4")


def test_hash_video(mp4):
    four, five = decode_video(mp4, 4), decode_video(mp4, 5)
    assert hash_video(four) == hash_video(decode_video(_encode(COLORS), 4))
    assert hash_video(four) != hash_video(five)
    assert hash_video(four) != hash_video(four.astype(np.int16))
    assert hash_video(mp4) == hash_video(bytearray(mp4)) != hash_video(four)


def test_thin_frames_refused_before_decoding():
    """Frames past max_image_aspect_ratio are refused from the stream's header (as images are), and decoded frames
    given as arrays by the offline API are checked the same way."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 2, "yuv420p"
        for _ in range(2):
            out.mux(
                stream.encode(
                    av.VideoFrame.from_ndarray(np.zeros((2, 64, 3), np.uint8), format="rgb24")
                )
            )
        out.mux(stream.encode())
    thin = buf.getvalue()
    assert decode_video(thin, 2).shape == (2, 2, 64, 3)
    with pytest.raises(
        MediaError,
        match="video: a video frame is 64x2 pixels, an aspect ratio above "
        "max_image_aspect_ratio=16",
    ):
        decode_video(thin, 2, MediaConfig(max_image_aspect_ratio=16), field="video")


def test_decoded_frames_are_checked_like_pictures(tiny_llava_dir):
    from transformers import AutoConfig

    from mmserve.models.registry import get_model_class
    from mmserve.multimodal.processors import InputProcessor

    hf_config = AutoConfig.from_pretrained(tiny_llava_dir)
    processor = InputProcessor(tiny_llava_dir, hf_config, get_model_class(hf_config))
    with pytest.raises(
        ValueError, match=r"videos\[0\]: a video frame is 300x1 pixels, an aspect ratio above"
    ):
        processor._load_videos([np.zeros((2, 1, 300, 3), np.uint8)], 2)
