"""LLaVA-OneVision family: SigLIP tower + MLP projector + Qwen2 backbone; anyres_max images and videos.

Images are packed like LLaVA-NeXT's (the same `anyres` code) with OneVision's anyres_max downscaling;
a video's frames are encoded as single tiles, 2x bilinear pooled, and followed by one image_newline.
"""

from __future__ import annotations

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.models.anyres import num_video_tokens, pool_frames
from mmserve.models.family import ClientFormat, FamilySpec, PromptFormat
from mmserve.models.llava_next import LlavaNextForConditionalGeneration, check_lengths, image_items
from mmserve.models.registry import register_family
from mmserve.multimodal.placeholder_expansion import placeholder_runs


@register_family(
    FamilySpec(
        name="llava_onevision",
        architectures=("LlavaOnevisionForConditionalGeneration",),
        model_types=("llava_onevision",),
        prompt=PromptFormat(
            "<image>",
            "<|im_start|>user ",
            "<|im_end|><|im_start|>assistant\n",
            image_sep="\n",
            video_token="<video>",
        ),
        client=ClientFormat("llava_onevision"),
    )
)
class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    """Images as in LLaVA-NeXT (plus anyres_max); videos as pooled frames + newline."""

    @classmethod
    def build_mm_items(
        cls, hf_config, enc, ids: list[int], image_keys: list[str], video_keys: list[str]
    ) -> list[MultiModalItem]:
        """Images as LLaVA-NeXT's; each video's `<video>` run and its frames [F, 3, H, W]."""
        items = image_items(hf_config, enc, ids, image_keys)
        if not video_keys:
            return items
        vc = hf_config.vision_config
        grid = vc.image_size // vc.patch_size
        videos = enc["pixel_values_videos"]  # [V, F, 3, H, W]
        if tuple(videos.shape[-2:]) != (vc.image_size, vc.image_size):
            raise ValueError(
                f"expected video frames of {vc.image_size}x{vc.image_size}, got {list(videos.shape)}"
            )
        frames = videos.shape[1]
        length = num_video_tokens(frames, grid)
        limit = hf_config.text_config.max_position_embeddings
        if length * len(video_keys) >= limit:
            raise ValueError(
                f"too many video frames: {len(video_keys)} video(s) of {frames} frames need "
                f"{length * len(video_keys)} tokens, beyond the model's context of {limit}"
            )
        offsets = placeholder_runs(ids, hf_config.video_token_index, [length] * len(video_keys))
        items += [
            MultiModalItem("video", {"pixel_values_videos": videos[k]}, off, length, video_keys[k])
            for k, off in enumerate(offsets)
        ]
        return items

    def embed_videos(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Frames of all videos in one tower batch; each video -> [F * pooled**2 + 1, text_hidden]."""
        clips = [it.data["pixel_values_videos"] for it in items]
        feats = pool_frames(self.encode_tiles(torch.cat(clips)), self.anyres.grid)
        per_frame = len(feats) // sum(len(c) for c in clips)
        out = feats.split([len(c) * per_frame for c in clips])
        return [torch.cat([f, self.image_newline[None].to(f)]) for f in out]

    def get_mm_embeddings(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Returns one [length, text_hidden] tensor per item (images and videos, in the given order)."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for modality, embed in (("image", self.embed_images), ("video", self.embed_videos)):
            idx = [i for i, it in enumerate(items) if it.modality == modality]
            if idx:
                for i, emb in zip(idx, embed([items[i] for i in idx])):
                    out[i] = emb
        return check_lengths(items, out)
