"""INT8 weight-only linear math (W8A16, `--quantization int8`, TensorRT-LLM's `--use_weight_only
--weight_only_precision int8`): weights stored as int8 with one fp32 scale per output row, activations in the
model's dtype.

A weight W [N, K] is stored as q = round(W / s) clamped to [-127, 127] with s[n] = max|W[n]| / 127, and

    y[m, n] = s[n] * sum_k x[m, k] * q[n, k]   (+ bias[n]),

summed in fp32. Half the weight memory and reads of fp16. On CUDA a one-row activation (batch-1 decode, where a
step is a stream of weight reads) goes through the Triton GEMV (kernels/gemv.py, int8 rows, the scale applied
after the sum); more rows multiply by the weight dequantized to the activations' dtype for that call. The CPU
computes the formula above in the activations' dtype (fp32 on the CPU: exact up to summation order).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127.0


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], fp32 scale [N]): each output row scaled so its largest magnitude maps to 127."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX
    return torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight the int8 one stands for, [N, K] in `dtype`."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(weight)^T (+ bias); x [..., K] in the model's dtype, weight int8 [N, K], scale fp32 [N]."""
    if x.is_cuda and x.numel() == x.shape[-1]:   # one row: the GEMV reads the int8 rows as they are
        from mmserve.kernels.gemv import gemv
        ones = torch.ones(1, dtype=torch.float32, device=x.device)
        y = gemv(x.reshape(-1), weight, bias, ones, scale, x.dtype)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, dequantize_int8(weight, scale, x.dtype), bias)
