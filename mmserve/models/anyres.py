"""Anyres image packing shared by LLaVA-NeXT and LLaVA-OneVision, and OneVision's video-frame pooling.

An image is a base tile (the whole picture resized) plus a mosaic of tiles cut from it resized to the
best `image_grid_pinpoints` resolution. Its tokens are the base tile's features, then the mosaic's
feature grid with the letterbox padding removed (and, for `anyres_max_N`, downscaled to about N tiles),
each row ended by `image_newline`. Placeholder counts and packed features come from the same functions,
so the prompt always has exactly as many placeholders as the model gives embeddings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_RATIO = 1.1  # anyres_max_N downscales only grids more than 10% (per side) above N tiles


def select_best_resolution(
    size: tuple[int, int], pinpoints: list[tuple[int, int]]
) -> tuple[int, int]:
    """The (height, width) pinpoint that keeps most of the image's pixels, then wastes least; size is (h, w)."""
    h, w = size
    best, best_kept, best_wasted = None, 0, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        wasted = ph * pw - kept
        if kept > best_kept or (kept == best_kept and wasted < best_wasted):
            best, best_kept, best_wasted = (ph, pw), kept, wasted
    return best


def unpad_box(size: tuple[int, int], rows: int, cols: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the image inside a rows x cols letterboxed grid (HF's rounding)."""
    h, w = size
    if w / h > cols / rows:  # wider than the grid: padding above and below
        pad = (rows - int(round(h * (cols / w), 7))) // 2
        return pad, rows - pad, 0, cols
    pad = (cols - int(round(w * (rows / h), 7))) // 2
    return 0, rows, pad, cols - pad


def parse_max_tiles(vision_aspect_ratio: str | None) -> int | None:
    """ "anyres_max_9" -> 9; None (LLaVA-NeXT: plain anyres) -> None."""
    if vision_aspect_ratio is None:
        return None
    m = re.fullmatch(r"anyres_max_(\d+)", vision_aspect_ratio)
    if not m or int(m.group(1)) < 1:
        raise ValueError(
            f"vision_aspect_ratio {vision_aspect_ratio!r} is not supported (expected 'anyres_max_<N>')"
        )
    return int(m.group(1))


@dataclass(frozen=True)
class AnyresSpec:
    pinpoints: tuple[tuple[int, int], ...]  # candidate mosaic resolutions (height, width) in pixels
    tile: int  # tile side in pixels (the vision tower's image_size)
    grid: int  # features per tile side (tile // patch_size)
    max_tiles: int | None = None  # anyres_max_N; None = never downscale (LLaVA-NeXT)

    @classmethod
    def from_config(cls, config) -> AnyresSpec:
        vc = config.vision_config
        pins = tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints)
        if not pins or any(h % vc.image_size or w % vc.image_size for h, w in pins):
            raise ValueError(
                f"image_grid_pinpoints {config.image_grid_pinpoints} must be multiples of the "
                f"vision image_size {vc.image_size}"
            )
        return cls(
            pins,
            vc.image_size,
            vc.image_size // vc.patch_size,
            parse_max_tiles(getattr(config, "vision_aspect_ratio", None)),
        )

    def tile_grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """Tiles down and across the mosaic of an image of size (h, w)."""
        ph, pw = select_best_resolution(size, list(self.pinpoints))
        return ph // self.tile, pw // self.tile

    def num_tiles(self, size: tuple[int, int]) -> int:
        """Tiles the image processor cuts for one image: the mosaic plus the base tile."""
        r, c = self.tile_grid(size)
        return r * c + 1

    def _scaled_shape(self, rows: int, cols: int) -> tuple[int, int] | None:
        """anyres_max_N target grid for an unpadded rows x cols grid, or None to keep it."""
        if self.max_tiles is None:
            return None
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.grid**2))
        return (int(rows // ratio), int(cols // ratio)) if ratio > MAX_RATIO else None

    def feature_grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """Rows x cols of the mosaic's features after unpadding (and anyres_max downscaling)."""
        r, c = self.tile_grid(size)
        top, bottom, left, right = unpad_box(size, r * self.grid, c * self.grid)
        rows, cols = bottom - top, right - left
        return self._scaled_shape(rows, cols) or (rows, cols)

    def num_tokens(self, size: tuple[int, int], tiled: bool = True) -> int:
        """Placeholders of one image: base tile + mosaic rows each ended by a newline (base + newline if not tiled)."""
        if not tiled:
            return self.grid**2 + 1
        rows, cols = self.feature_grid(size)
        return self.grid**2 + rows * (cols + 1)

    def pack(
        self, tiles: torch.Tensor, size: tuple[int, int], newline: torch.Tensor
    ) -> torch.Tensor:
        """tiles [T, grid*grid, D] (base first) of an image of size (h, w) -> [num_tokens, D]."""
        g = self.grid
        if len(tiles) == 1:  # base tile only (OneVision multi-image)
            return torch.cat([tiles[0], newline[None].to(tiles)])
        r, c = self.tile_grid(size)
        if len(tiles) != r * c + 1:
            raise ValueError(f"image of size {size} needs {r * c + 1} tiles, got {len(tiles)}")
        # [r*c, g*g, D] -> [D, r*g, c*g]: tile rows then patch rows down, tile cols then patch cols across
        x = (
            tiles[1:]
            .view(r, c, g, g, -1)
            .permute(4, 0, 2, 1, 3)
            .contiguous()
            .flatten(1, 2)
            .flatten(2, 3)
        )
        top, bottom, left, right = unpad_box(size, r * g, c * g)
        x = x[:, top:bottom, left:right]
        scaled = self._scaled_shape(bottom - top, right - left)
        if scaled is not None:
            x = F.interpolate(x[None], list(scaled), mode="bilinear")[0]
        x = torch.cat([x, newline[:, None, None].expand(*x.shape[:-1], 1).to(x)], dim=-1)
        return torch.cat([tiles[0], x.flatten(1, 2).transpose(0, 1)])


def pooled_side(grid: int) -> int:
    """Features per side of a video frame after 2x bilinear pooling."""
    return math.ceil(grid / 2)


def num_video_tokens(num_frames: int, grid: int) -> int:
    """Placeholders of one OneVision video: pooled features of every frame, then one newline."""
    return num_frames * pooled_side(grid) ** 2 + 1


def pool_frames(frames: torch.Tensor, grid: int) -> torch.Tensor:
    """frames [F, grid*grid, D] -> [F * pooled_side(grid)**2, D], bilinear 2x downscaling per frame."""
    n, _, d = frames.shape
    p = pooled_side(grid)
    x = frames.view(n, grid, grid, d).permute(0, 3, 1, 2).contiguous()
    x = F.interpolate(x, size=[p, p], mode="bilinear")
    return x.permute(0, 2, 3, 1).reshape(n * p * p, d)
