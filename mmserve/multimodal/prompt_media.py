"""A prompt dict's media parts, checked and loaded: images/videos as lists, preprocessed pixel values, videos
as decoded frames [F, H, W, 3] (sources decoded, given frames checked against the media limits).

Pictures are loaded here for every API: a server's (`AsyncEngine.preprocess`) by `aload_prompt_media`, its downloads
concurrent under the media limits' deadline, before the preprocessing thread; the offline API's by the input
processor (`load_images`). A frontend passes the sources on as they came, with the name of the field that carried
them (`MEDIA_FIELD`), which its errors then name."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mmserve.multimodal.inputs import aload_images, load_video_bytes
from mmserve.multimodal.media_limits import MediaConfig, check_picture_size
from mmserve.multimodal.video import decode_video


def as_list(value: Any) -> list:
    """None -> [], a list or tuple -> a list of its items, anything else -> [value]."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


MEDIA_FIELD = "media_field"  # prompt key: the API field the pictures came in (errors name it)


async def aload_prompt_media(prompt: Any, config: MediaConfig) -> Any:
    """A server's prompt with its pictures loaded (any source: URL, data URI, path, bytes, array; fetched at once,
    decoded in worker threads) and checked against `config`; MediaError (a ValueError) names the field and index."""
    if not isinstance(prompt, dict) or (not prompt.get("images") and MEDIA_FIELD not in prompt):
        return prompt
    out = dict(prompt)
    field = out.pop(MEDIA_FIELD, None) or "images"
    if out.get("images"):
        out["images"] = await aload_images(as_list(out["images"]), config, field=field)
    return out


def check_pixel_values(pixel_values: Any) -> torch.Tensor:
    """Already-preprocessed images as a float32 tensor [num_images, 3, H, W] (one [3, H, W] image too);
    ValueError for any other shape or dtype, or non-finite values."""
    pv = torch.as_tensor(pixel_values)
    if pv.dim() == 3:
        pv = pv.unsqueeze(0)
    if pv.dim() != 4 or pv.shape[1] != 3 or not pv.is_floating_point():
        raise ValueError(
            f"pixel_values must be a float tensor [num_images, 3, H, W], got "
            f"{pv.dtype} {list(pv.shape)}"
        )
    if not torch.isfinite(pv).all():
        raise ValueError("pixel_values contain NaN or infinite values")
    return pv.float()


def load_videos(videos: list, num_frames: Any, media: MediaConfig) -> list[np.ndarray]:
    """Each video as uint8 frames [F, H, W, 3]: decoded frames are checked against `media`'s limits, any other
    source (URL, data URI, path, bytes) is loaded and `num_frames` frames decoded from it."""
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"video_num_frames must be a positive integer, got {num_frames!r}")
    out = []
    for i, v in enumerate(videos):
        field_name = f"videos[{i}]"
        if isinstance(v, np.ndarray):  # already decoded frames [F, H, W, 3]
            if v.ndim != 4 or v.shape[-1] != 3 or v.dtype != np.uint8:
                raise ValueError(
                    f"{field_name}: decoded frames must be uint8 [F, H, W, 3], got "
                    f"{v.dtype} {list(v.shape)}"
                )
            if not 1 <= len(v) <= media.max_video_frames:
                raise ValueError(
                    f"{field_name}: {len(v)} frames, allowed 1 to "
                    f"max_video_frames={media.max_video_frames}"
                )
            check_picture_size(v.shape[2], v.shape[1], media, field_name, "a video frame")
            out.append(v)
        else:
            out.append(
                decode_video(
                    load_video_bytes(v, media, field=field_name),
                    num_frames,
                    media,
                    field=field_name,
                )
            )
    return out
