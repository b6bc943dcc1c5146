"""SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for LLMs"): per
smoothing site, s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) over input channel j (X: every calibration token's
input; W: the consumers' weights stacked), which moves the activations' outlier channels into the weights by the
migration strength alpha. s divides the producer (a norm's weight, or rows of up) and multiplies the consumers'
columns, an identity of the unquantized model; the consumers' weights are then int8, symmetric, one scale per
output channel, and their inputs int8 per token at run time (dynamic): compressed-tensors' "int-quantized" W8A8.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def smoothquant_scales(
    act_max: torch.Tensor, weight: torch.Tensor, alpha: float, floor: float = 1e-5
) -> torch.Tensor:
    """s [K] = max|X_j|^alpha / max_i |W_ij|^(1-alpha), both maxima floored at `floor`."""
    w_max = weight.float().abs().amax(dim=0).clamp(min=floor)
    s = act_max.float().clamp(min=floor).pow(alpha) / w_max.pow(1.0 - alpha)
    return s.clamp(min=floor)


def quantize_int8_per_channel(
    weight: torch.Tensor, scale_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """{"weight": int8 [N, K], "weight_scale": [N, 1] in `scale_dtype`} with W ~= weight * weight_scale
    (symmetric: max |w| of a row maps to 127). The rounding uses the scale as stored, so a reader that
    multiplies back gets within half a step of W."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / INT8_MAX).clamp(min=1e-12).to(scale_dtype)
    q = torch.round(w / scale.float()).clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
    return {"weight": q, "weight_scale": scale}
