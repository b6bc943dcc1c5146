"""FP8 (e4m3) W8A8 linear math: how weights and activations are scaled into e4m3, and the matmul over them.

A weight W [N, K] is stored as fp8(W / s_w) with one scale per output row (`quantize_weight`; checkpoints
with one scale per tensor or per fused shard become rows of equal scales). An activation row x is
quantized on the fly to fp8(clamp(x / s_x, +-448)), where s_x = max|x| / 448 per row ("dynamic", the
default) or one calibrated scale from the checkpoint ("static", `input_scale`). Then

    y[m, n] = s_x[m] * s_w[n] * sum_k xq[m, k] * wq[n, k]   (+ bias[n]),

accumulated in fp32. `fp8_linear` runs it with FP8 tensor cores on GPUs that have them (compute capability
>= 8.9: kernels/fp8_gemm.py) and with this module's reference arithmetic everywhere else (CPU, older GPUs).
"""
from __future__ import annotations

import torch

from mmserve.attention.kv_quant import FP8_MAX   # 448, the format's largest finite value

FP8 = torch.float8_e4m3fn
AMAX_FLOOR = 1e-12   # an all-zero row still gets a finite scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], fp32 scale [N]): each output row scaled so its largest magnitude maps to 448."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x [M, K], fp32 scale [M]) for activations x [M, K]: per-row dynamic scales, or the static one."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(dim=1).clamp(min=AMAX_FLOOR) / FP8_MAX
    else:
        scale = input_scale.float().reshape(1).expand(len(x)).contiguous()
    return (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """The W8A8 product in plain torch (fp32 accumulation): the oracle the GPU kernels are tested against."""
    shape = x.shape
    xq, xs = quantize_rows(x.reshape(-1, shape[-1]), input_scale)
    y = (xq.float() @ weight.float().t()) * xs[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], weight.shape[0])


def fp8_supported(device: torch.device) -> bool:
    """Whether this device multiplies e4m3 on tensor cores (Ada / Hopper and newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(weight)^T (+ bias) with x quantized per row; x [..., K], weight fp8 [N, K]."""
    if x.is_cuda and fp8_supported(x.device):
        from mmserve.kernels.fp8_gemm import fp8_matmul
        shape = x.shape
        y = fp8_matmul(x.reshape(-1, shape[-1]), weight, weight_scale, input_scale, bias)
        return y.reshape(*shape[:-1], weight.shape[0])
    return fp8_linear_reference(x, weight, weight_scale, input_scale, bias)
