"""Decode an encoded video into uniformly sampled RGB frames with PyAV, refusing unsafe containers."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from typing import Any

import av
import numpy as np

from mmserve.multimodal.media_limits import MediaConfig, MediaError, check_picture_size

# Demuxers allowed to parse user bytes. Playlist-style ones (hls, concat, ...) would open further
# files or URLs; "none" as the protocol whitelist names no protocol, so no nested open can succeed.
_OPEN_OPTIONS = {
    "format_whitelist": "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,mpeg,flv,ogg,gif,asf",
    "protocol_whitelist": "none",
}


def sample_frame_indices(total: int, num_frames: int) -> np.ndarray:
    """num_frames indices spread uniformly over [0, total - 1], both ends included (repeats when total is small)."""
    return np.linspace(0, total - 1, num_frames).round().astype(np.int64)


@contextlib.contextmanager
def _open(data: bytes, config: MediaConfig, field: str) -> Iterator[tuple[Any, Any]]:
    try:
        with av.open(io.BytesIO(data), options=_OPEN_OPTIONS) as container:
            if not container.streams.video:
                raise MediaError(f"{field}: data cannot be decoded as a video (no video stream)")
            stream = container.streams.video[0]
            check_picture_size(
                stream.codec_context.width,
                stream.codec_context.height,
                config,
                field,
                "a video frame",
            )
            yield container, stream
    except MediaError:
        raise
    except Exception as exc:  # FFmpeg and PyAV raise many exception types on corrupt input
        raise MediaError(f"{field}: data cannot be decoded as a video") from exc


def _frame_count(data: bytes, config: MediaConfig, field: str) -> int:
    """The container's frame count, else the number of video packets (demuxed, not decoded)."""
    with _open(data, config, field) as (container, stream):
        if stream.frames > 0:
            return stream.frames
        return sum(1 for packet in container.demux(stream) if packet.size)


def _decode_frames(
    data: bytes, indices: np.ndarray, config: MediaConfig, field: str
) -> tuple[dict[int, np.ndarray], int]:
    """Decode the whole stream keeping only frames at `indices`; also return how many frames decoded."""
    wanted = set(indices.tolist())
    kept: dict[int, np.ndarray] = {}
    count = 0
    size = None
    with _open(data, config, field) as (container, stream):
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            check_picture_size(frame.width, frame.height, config, field, "a video frame")
            if count in wanted:
                # the resolution may change mid-stream; every kept frame takes the first one's size
                size = size or (frame.width, frame.height)
                kept[count] = frame.to_ndarray(format="rgb24", width=size[0], height=size[1])
            count += 1
    return kept, count


def decode_video(
    data: bytes | bytearray | memoryview,
    num_frames: int,
    config: MediaConfig = MediaConfig(),
    *,
    field: str = "video",
) -> np.ndarray:
    """Encoded video -> [num_frames, H, W, 3] uint8 RGB frames sampled uniformly over the whole video."""
    if (
        isinstance(num_frames, bool)
        or not isinstance(num_frames, (int, np.integer))
        or not 1 <= num_frames <= config.max_video_frames
    ):
        raise MediaError(
            f"{field}: num_frames must be an int in [1, max_video_frames={config.max_video_frames}], "
            f"got {num_frames!r}"
        )
    if memoryview(data).nbytes > config.max_media_bytes:
        raise MediaError(f"{field}: item is larger than max_media_bytes={config.max_media_bytes}")
    data = data if isinstance(data, bytes) else bytes(data)
    total = _frame_count(data, config, field)
    if total < 1:
        raise MediaError(f"{field}: video has no frames")
    indices = sample_frame_indices(total, num_frames)
    frames, decoded = _decode_frames(data, indices, config, field)
    if (
        decoded != total
    ):  # the container's count was wrong: sample again over the frames that really decode
        if decoded == 0:
            raise MediaError(f"{field}: data cannot be decoded as a video (no frame decodes)")
        indices = sample_frame_indices(decoded, num_frames)
        frames, _ = _decode_frames(data, indices, config, field)
    if any(int(i) not in frames for i in indices):
        raise MediaError(
            f"{field}: data cannot be decoded as a video (frame count changed between passes)"
        )
    return np.stack([frames[int(i)] for i in indices])
