"""FP8 KV cache: how keys/values are scaled into e4m3 and back (the torch backend's reference; the Triton
kernels do the same arithmetic in-register).

A cached value x is stored as fp8(clamp(x * (1 / scale), +-FP8_MAX)) and read as fp8_value * scale, with one
scale per layer for K and one for V. Caches in the model's dtype ignore the scales.
"""

from __future__ import annotations

import torch

from mmserve.kernels.fp8_format import FP8_MAX, is_fp8


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in the cache's dtype; fp8 caches get x / scale, saturated to the format's range."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    # multiply by the reciprocal (not divide) so the Triton write kernel rounds identically
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached values as `dtype` (fp8 ones times their scale)."""
    y = x.to(dtype)
    return y * scale if is_fp8(x.dtype) and scale != 1.0 else y
