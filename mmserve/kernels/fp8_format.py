"""The e4m3 FP8 format as mmserve uses it, shared by the kernels, the FP8 linear layers and the FP8 KV cache: the
dtype and its largest value, the scales a cache of a given dtype applies, and activations already quantized per
row."""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = float(
    torch.finfo(torch.float8_e4m3fn).max
)  # 448: e4m3fn has no inf, overflow would be NaN
AMAX_FLOOR = 1e-12  # an all-zero row still gets a finite scale


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def cache_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The (k, v) scales that apply to a cache of this dtype: its own for FP8, (1, 1) for the model's dtype."""
    return (k_scale, v_scale) if is_fp8(cache_dtype) else (1.0, 1.0)


class QuantizedRows(NamedTuple):
    """Activations already quantized per row (a norm or activation kernel fused the quantization into its output),
    for a W8A8 linear layer to take as they are: e4m3 as `quantize_rows` makes them (FP8 layers) or int8 as
    `quantize_rows_int8` does (int8 W8A8 layers)."""

    q: torch.Tensor  # [M, K] e4m3 or int8
    scale: torch.Tensor  # [M] fp32
    dtype: torch.dtype  # of the activations before quantization: the layer's output dtype
