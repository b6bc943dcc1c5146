"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization", as AutoAWQ runs it): per smoothing site, scales
s = mean|x|^alpha (normalised so that max(s) * min(s) = 1) for the consumers' input channels, alpha chosen on a
grid of 20 points in [0, 1) to minimise the consumers' output error on the sampled calibration rows once their
weights W * s are int4 in groups (round-to-nearest with a zero point, layers/group_int4.quantize_groups) and the
input divided by s. s folds into the producer (a norm's weight, or rows of v / up) and the consumers' columns, so
the unquantized model computes the same function; then each consumer's W * s is quantized and packed in
AutoAWQ's GEMM layout (group_int4.pack_awq).

Differences from AutoAWQ: all sites are searched on one calibration pass of the unquantized model (AutoAWQ runs
the calibration inputs layer by layer through the already quantized layers before), the error is the consumers'
linear outputs (AutoAWQ's is the whole attention / MLP block's output for q/k/v and gate/up), and there is no
weight clipping search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.layers.group_int4 import dequantize_groups, pack_awq, quantize_groups

GRID = 20


@dataclass
class SearchResult:
    """One site's chosen scales, the alpha that gave them and the output error at each alpha of the grid."""

    scales: torch.Tensor  # [K] float32
    alpha: float
    errors: list[float]


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """`weight` [N, K] after a round trip through group-wise int4 (fp32)."""
    q, scales, zeros = quantize_groups(weight.float(), group_size, zero_point=True)
    return dequantize_groups(q, scales, zeros, group_size)


def output_error(
    rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int
) -> float:
    """Mean squared error of rows [R, K] through `weight` [N, K] vs through int4(weight * s) / s."""
    ref = rows @ weight.t()
    w_q = fake_quantize(weight * scales, group_size) / scales
    return float((rows @ w_q.t() - ref).pow(2).mean())


def awq_scales(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha, clamped away from 0 and normalised so that max(s) * min(s) = 1 (alpha 0: all ones)."""
    s = abs_mean.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scales(
    rows: torch.Tensor, abs_mean: torch.Tensor, weight: torch.Tensor, group_size: int
) -> SearchResult:
    """The grid search of one site: `rows` [R, K] sampled inputs, `abs_mean` [K] mean |x| over all calibration
    tokens, `weight` [N, K] the consumers' weights stacked. alpha 0 (plain round-to-nearest) is on the grid, so
    the chosen error is never above RTN's on these rows."""
    rows, weight = rows.float(), weight.float()
    errors = [
        output_error(rows, weight, awq_scales(abs_mean, i / GRID), group_size) for i in range(GRID)
    ]
    best = min(range(GRID), key=errors.__getitem__)
    return SearchResult(awq_scales(abs_mean, best / GRID), best / GRID, errors)


def quantize_awq(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """A smoothed weight [N, K] as AutoAWQ GEMM tensors {"qweight", "qzeros", "scales"}."""
    q, scales, zeros = quantize_groups(weight.float(), group_size, zero_point=True)
    return pack_awq(q, zeros, scales)
