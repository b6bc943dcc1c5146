"""FP8 (e4m3) W8A8 linear math: how weights and activations are scaled into e4m3, and the matmul over them.

A weight W [N, K] is stored as fp8(W / s_w) with one scale per output row (`quantize_weight`; checkpoints
with one scale per tensor or per fused shard become rows of equal scales). An activation row x is
quantized on the fly to fp8(clamp(x * (1 / s_x), +-448)), where s_x = max|x| / 448 per row ("dynamic", the
default) or one calibrated scale from the checkpoint ("static", `input_scale`). Multiplying by the row's
reciprocal (one IEEE division per row) instead of dividing every element lets the GPU kernels that quantize
(kernels/fp8_gemm.py, kernels/fused_ops.py) produce the same bits at the cost of one multiply: on an H200 the
fused SiLU-and-mul + quantization of 4,096 rows of 11,008 took 64 instead of 120 µs. Then

    y[m, n] = s_x[m] * s_w[n] * sum_k xq[m, k] * wq[n, k]   (+ bias[n]),

accumulated in fp32. `fp8_linear` runs it with FP8 tensor cores on GPUs that have them (compute capability
>= 8.9: kernels/fp8_gemm.py, whose large GEMMs accumulate in the tensor cores' narrower accumulator for fp16 /
bf16 outputs) and with this module's reference arithmetic everywhere else (CPU, older GPUs).
"""

from __future__ import annotations

import torch

from mmserve.kernels.fp8_format import (
    AMAX_FLOOR,
    FP8,
    FP8_MAX,  # 448, the format's largest finite value
    QuantizedRows,
)


def quantize_weight(
    weight: torch.Tensor, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], fp32 scale [N]): each output row scaled so its largest magnitude (`amax` [N] when given:
    a row-parallel shard's rows are part of longer ones) maps to 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) if amax is None else amax).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_rows(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x [M, K], fp32 scale [M]) for activations x [M, K]: per-row dynamic scales, or the static one."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(dim=1).clamp(min=AMAX_FLOOR) / FP8_MAX
    else:
        scale = input_scale.float().reshape(1).expand(len(x)).contiguous()
    return (xf * (1.0 / scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_reference(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The W8A8 product in plain torch (fp32 accumulation): the oracle the GPU kernels are tested against."""
    if isinstance(x, QuantizedRows):
        xq, xs, dtype, shape = x.q, x.scale, x.dtype, x.q.shape
    else:
        shape, dtype = x.shape, x.dtype
        xq, xs = quantize_rows(x.reshape(-1, shape[-1]), input_scale)
    y = (xq.float() @ weight.float().t()) * xs[:, None] * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype).reshape(*shape[:-1], weight.shape[0])


def fp8_supported(device: torch.device) -> bool:
    """Whether this device multiplies e4m3 on tensor cores (Ada / Hopper and newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class QuantizesRows:
    """Mixin of a module whose output feeds one W8A8 linear layer (paired by models/quantization.
    fuse_activation_quantization): the module's kernel returns its output already quantized for that layer
    (QuantizedRows: e4m3 for an FP8 layer on GPUs with FP8 tensor cores, int8 for an int8 W8A8 layer on any CUDA
    GPU), so the layer does not quantize it in a kernel of its own. Elsewhere the output stays a plain tensor."""

    _consumer: tuple = ()

    def quantize_for(self, linear) -> None:
        self._consumer = (linear,)  # a tuple: not registered as a submodule

    def rows_consumer(self, x: torch.Tensor):
        """The linear to quantize x's output for (its weight's dtype, e4m3 or int8, is the rows'), or None."""
        if not self._consumer or x.dim() != 2 or not x.is_cuda:
            return None
        linear = self._consumer[0]
        return linear if not linear.is_fp8 or fp8_supported(x.device) else None

    def quantize_args(self, x: torch.Tensor) -> dict:
        """The keywords that make kernels/fused_ops.rms_norm / silu_and_mul quantize x's output for the consumer
        (`quantize`, `input_scale`, `rows_dtype`); none where the output stays a plain tensor."""
        linear = self.rows_consumer(x)
        if linear is None:
            return {}
        return dict(quantize=True, input_scale=linear.input_scale, rows_dtype=linear.weight.dtype)


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ dequant(weight)^T (+ bias) with x quantized per row; x [..., K] (or already quantized rows
    [M, K]), weight fp8 [N, K]."""
    rows = x.q if isinstance(x, QuantizedRows) else x
    if rows.is_cuda and fp8_supported(rows.device):
        from mmserve.kernels.fp8_gemm import fp8_matmul, fp8_matmul_quantized

        if isinstance(x, QuantizedRows):
            return fp8_matmul_quantized(x.q, x.scale, weight, weight_scale, bias, x.dtype)
        shape = x.shape
        y = fp8_matmul(x.reshape(-1, shape[-1]), weight, weight_scale, input_scale, bias)
        return y.reshape(*shape[:-1], weight.shape[0])
    return fp8_linear_reference(x, weight, weight_scale, input_scale, bias)
