"""Donut Swin: the hierarchical shifted-window ViT that encodes pages for Donut and Nougat.

Mirrors transformers' `DonutSwinModel` (parameter names included, so a VisionEncoderDecoder checkpoint's
`encoder.X` tensors load by stripping the prefix): [N, 3, H, W] -> last_hidden_state [N, tokens, hidden]. There is
no final norm; HF's optional average pooler is not part of last_hidden_state and is left out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.layers.activation import get_act_fn
from mmserve.layers.linear import ReplicatedLinear
from mmserve.models.weights import load_weights

SHIFT_MASK = (
    -100.0
)  # HF's (and the Swin paper's) additive bias between tokens of different shifted regions


def _pair(x: int | Iterable[int]) -> tuple[int, int]:
    return tuple(x) if isinstance(x, Iterable) else (x, x)


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """[N, H, W, C] (H, W multiples of window) -> [N, windows, window * window, C], windows in row-major order."""
    n, h, w, c = x.shape
    x = x.view(n, h // window, window, w // window, window, c).transpose(2, 3)
    return x.reshape(n, (h // window) * (w // window), window * window, c)


def window_merge(windows: torch.Tensor, window: int, h: int, w: int) -> torch.Tensor:
    """Inverse of window_partition: [N, windows, window * window, C] -> [N, H, W, C]."""
    n, c = windows.shape[0], windows.shape[-1]
    x = windows.view(n, h // window, w // window, window, window, c).transpose(2, 3)
    return x.reshape(n, h, w, c)


def relative_position_index(window: int) -> torch.Tensor:
    """[S, S] (S = window^2): row into the (2w-1)^2 bias table for the offset of token p from token q."""
    rows, cols = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    d_row = rows[:, None] - rows[None, :] + window - 1  # [S, S] in [0, 2w-2]
    d_col = cols[:, None] - cols[None, :] + window - 1
    return d_row * (2 * window - 1) + d_col


def shift_mask(
    h: int, w: int, window: int, shift: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Additive [windows, S, S] mask for a map of h x w (padded) cyclically shifted by -shift on both axes.

    After the roll, the last `window` rows hold pieces from three bands of the original map: [0, h - window),
    [h - window, h - shift), [h - shift, h) (columns alike). Tokens attend only tokens of the same band pair.
    """

    def bands(size: int) -> torch.Tensor:
        i = torch.arange(size, device=device)
        return (i >= size - window).long() + (i >= size - shift).long()

    region = bands(h)[:, None] * 3 + bands(w)[None, :]  # [h, w]
    region = window_partition(region[None, :, :, None], window)[0, :, :, 0]  # [windows, S]
    different = region[:, :, None] != region[:, None, :]
    return torch.zeros(different.shape, device=device, dtype=dtype).masked_fill(
        different, SHIFT_MASK
    )


class DonutSwinPatchEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = _pair(config.patch_size)
        self.projection = nn.Conv2d(
            config.num_channels, config.embed_dim, self.patch_size, self.patch_size
        )

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """[N, C, H, W] -> ([N, h * w, embed_dim], h, w); H and W are zero-padded (bottom, right) to patches."""
        ph, pw = self.patch_size
        x = F.pad(pixel_values, (0, -pixel_values.shape[-1] % pw, 0, -pixel_values.shape[-2] % ph))
        x = self.projection(x)
        h, w = x.shape[-2:]
        return x.flatten(2).transpose(1, 2), h, w


class DonutSwinEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.use_absolute_embeddings:
            # HF adds num_patches + 1 positions to num_patches tokens, which only works when interpolating
            raise NotImplementedError(
                "DonutSwin with use_absolute_embeddings=True is not supported"
            )
        self.patch_embeddings = DonutSwinPatchEmbeddings(config)
        self.norm = nn.LayerNorm(
            config.embed_dim
        )  # HF uses LayerNorm's default eps here, not layer_norm_eps

    def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x, h, w = self.patch_embeddings(pixel_values)
        return self.norm(x), h, w


class DonutSwinSelfAttention(nn.Module):
    """q/k/v of the tokens of each window plus a learned bias per (relative offset, head)."""

    def __init__(self, config, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not a multiple of {num_heads} attention heads")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        window = config.window_size
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window - 1) ** 2, num_heads)
        )
        self.register_buffer(
            "relative_position_index", relative_position_index(window), persistent=False
        )
        self.query = ReplicatedLinear(dim, dim, bias=config.qkv_bias)
        self.key = ReplicatedLinear(dim, dim, bias=config.qkv_bias)
        self.value = ReplicatedLinear(dim, dim, bias=config.qkv_bias)

    def position_bias(self) -> torch.Tensor:
        """[heads, S, S]."""
        s = self.relative_position_index.shape[0]
        return (
            self.relative_position_bias_table[self.relative_position_index.flatten()]
            .view(s, s, -1)
            .permute(2, 0, 1)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # x [N, windows, S, dim]; mask [windows, S, S] additive or None
        n, nw, s, dim = x.shape
        bias = self.position_bias().to(x.dtype)  # [heads, S, S]
        bias = (
            bias.expand(nw, -1, -1, -1) if mask is None else bias + mask[:, None]
        )  # [windows, heads, S, S]
        # windows x heads is one axis, so the bias broadcasts over the batch without being copied per image
        q, k, v = (
            p(x)
            .view(n, nw, s, self.num_heads, self.head_dim)
            .transpose(2, 3)
            .reshape(n, -1, s, self.head_dim)
            for p in (self.query, self.key, self.value)
        )
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.reshape(1, -1, s, s), scale=self.head_dim**-0.5
        )
        return (
            o.view(n, nw, self.num_heads, s, self.head_dim).transpose(2, 3).reshape(n, nw, s, dim)
        )


class DonutSwinAttention(nn.Module):
    def __init__(self, config, dim: int, num_heads: int) -> None:
        super().__init__()
        self.self = DonutSwinSelfAttention(config, dim, num_heads)
        self.output = nn.ModuleDict(
            {"dense": ReplicatedLinear(dim, dim, bias=True)}
        )  # HF's `output.dense`

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output.dense(self.self(x, mask))


class DonutSwinBlock(nn.Module):
    """Pre-LN block: (shifted) window attention, then an MLP. HF's `DonutSwinLayer`."""

    def __init__(self, config, dim: int, num_heads: int) -> None:
        super().__init__()
        hidden = int(config.mlp_ratio * dim)
        self.layernorm_before = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.attention = DonutSwinAttention(config, dim, num_heads)
        self.layernorm_after = nn.LayerNorm(dim, eps=config.layer_norm_eps)
        self.intermediate = nn.ModuleDict({"dense": ReplicatedLinear(dim, hidden, bias=True)})
        self.output = nn.ModuleDict({"dense": ReplicatedLinear(hidden, dim, bias=True)})
        self.act = get_act_fn(config.hidden_act)

    def forward(
        self, x: torch.Tensor, h: int, w: int, window: int, shift: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """x [N, h * w, dim]; the map is zero-padded (after the norm) to multiples of `window`, rolled by -shift,
        attended window by window (padding tokens included, unmasked, as in HF) and cropped back."""
        n, _, dim = x.shape
        y = self.layernorm_before(x).view(n, h, w, dim)
        y = F.pad(y, (0, 0, 0, -w % window, 0, -h % window))
        hp, wp = y.shape[1:3]
        if shift:
            y = torch.roll(y, shifts=(-shift, -shift), dims=(1, 2))
        y = self.attention(window_partition(y, window), mask)
        y = window_merge(y, window, hp, wp)
        if shift:
            y = torch.roll(y, shifts=(shift, shift), dims=(1, 2))
        x = x + y[:, :h, :w].reshape(n, h * w, dim)
        return x + self.output.dense(self.act(self.intermediate.dense(self.layernorm_after(x))))


class DonutSwinPatchMerging(nn.Module):
    """2x2 neighbours -> one token: concat (top-left, bottom-left, top-right, bottom-right), LayerNorm, 4C -> 2C."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.reduction = ReplicatedLinear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)  # default eps, as in HF

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[N, h * w, C] -> [N, ceil(h / 2) * ceil(w / 2), 2C]; odd sizes get a zero row / column first."""
        n, _, c = x.shape
        x = F.pad(x.view(n, h, w, c), (0, 0, 0, w % 2, 0, h % 2))
        x = torch.cat(
            [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1
        )
        return self.reduction(self.norm(x.view(n, -1, 4 * c)))


class DonutSwinStage(nn.Module):
    """Blocks alternating plain and shifted windows, then (all but the last stage) a patch merging."""

    def __init__(self, config, dim: int, depth: int, num_heads: int, downsample: bool) -> None:
        super().__init__()
        self.window_size = config.window_size
        self.blocks = nn.ModuleList(DonutSwinBlock(config, dim, num_heads) for _ in range(depth))
        self.downsample = DonutSwinPatchMerging(dim) if downsample else None

    def forward(self, x: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, int, int]:
        # HF: odd blocks shift by window // 2, unless the map is no larger than a window on its short side, in which
        # case the window becomes that side and nothing shifts. HF's bias table keeps the configured window, so a
        # map strictly smaller than the window fails there (a shape error); we say so instead. HF also keeps the
        # turned-off shift on its block for later calls; we decide per call, which only differs across image sizes.
        window, shift = self.window_size, self.window_size // 2
        if min(h, w) <= window:
            window, shift = min(h, w), 0
        if window != self.window_size:
            raise ValueError(
                f"a {h}x{w} feature map is smaller than the {self.window_size}x{self.window_size} window "
                "(transformers' DonutSwin cannot run it either); use larger images"
            )
        mask = None
        if shift and len(self.blocks) > 1:
            mask = shift_mask(
                -(-h // window) * window, -(-w // window) * window, window, shift, x.device, x.dtype
            )
        for i, block in enumerate(self.blocks):
            odd = i % 2 == 1
            x = block(x, h, w, window, shift if odd else 0, mask if odd else None)
        if self.downsample is None:
            return x, h, w
        return self.downsample(x, h, w), (h + 1) // 2, (w + 1) // 2


class DonutSwinEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        n = len(config.depths)
        self.layers = nn.ModuleList(
            DonutSwinStage(
                config, config.embed_dim * 2**i, config.depths[i], config.num_heads[i], i < n - 1
            )
            for i in range(n)
        )


class DonutSwinTower(nn.Module):
    """HF `DonutSwinModel`'s last_hidden_state. Image sizes come from the input, not config.image_size (as in HF)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = DonutSwinEmbeddings(config)
        self.encoder = DonutSwinEncoder(config)
        self.hidden_size = config.embed_dim * 2 ** (len(config.depths) - 1)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, h * w, embed_dim * 2^(stages-1)] in row-major order, where the last stage's map
        is h = ceil(ceil(H / patch) / 2^(stages-1)) (halving with ceil each stage), w alike."""
        w = self.embeddings.patch_embeddings.projection.weight
        x, h, wd = self.embeddings(pixel_values.to(w.device, w.dtype))
        for stage in self.encoder.layers:
            x, h, wd = stage(x, h, wd)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs named as inside HF's DonutSwinModel (a checkpoint's `encoder.` stripped).
        The relative position indices are computed, so checkpoint copies of them are skipped."""
        load_weights(self, weights, ignore=(".relative_position_index",))
