"""Linear layers that know how they shard under tensor parallelism and how to load their weights.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)`; packed layers (QKV,
gate+up) accept their checkpoint parts by shard id. `_out_rows(shard_id)` says where a checkpoint part's
output rows land on this rank; weights, biases and FP8 weight scales all load through it.

A layer may hold an FP8 (e4m3) weight with one fp32 scale per output row (`weight_scale`) and, for
checkpoints calibrated that way, a static activation scale (`input_scale`): `to_fp8` converts a loaded
weight (--quantization fp8), `make_fp8` makes room for a pre-quantized checkpoint's tensors. The math is
layers/fp8_linear.py. Or an int8 / packed int4 weight with one fp32 scale per row (`to_weight_only`, --quantization
int8 | int4: weight-only, activations stay in the model's dtype; layers/weight_only.py). Or a `quant` state that
holds the weights and owns the matmul: group-wise int4 (AWQ / GPTQ checkpoints, --quantization int4_g128) or W8A8
int8 (compressed-tensors checkpoints, --quantization w8a8), layers/group_quant_linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from mmserve.kernels.fp8_format import FP8, QuantizedRows
from mmserve.layers.fp8_linear import fp8_linear, quantize_weight
from mmserve.layers.weight_only import (
    quantize_weight_int4,
    quantize_weight_int8,
    weight_only_linear,
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on CUDA in fp16/bf16 a single row (batch-1 decode) may go to the Triton GEMV instead, and up to
    SMALL_M rows (batched decode) to the Triton small-M GEMM, per shape whichever timed faster than cuBLAS."""
    if (
        x.is_cuda
        and x.dtype in (torch.float16, torch.bfloat16)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
    ):
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            from mmserve.kernels.gemv import linear_one_row

            return linear_one_row(x, weight, bias)
        from mmserve.kernels.m_tiles import SMALL_M
        from mmserve.kernels.weight_only_gemm import small_m_gemm

        if rows <= SMALL_M:
            from mmserve.kernels.fastest import run_fastest
            from mmserve.layers.weight_only import rows_bucket

            x2 = x.reshape(rows, -1).contiguous()
            key = (
                "linear_small_m",
                tuple(weight.shape),
                x.dtype,
                bias is not None,
                rows_bucket(rows),
                x.device,
            )
            y = run_fastest(
                key, [lambda: F.linear(x2, weight, bias), lambda: small_m_gemm(x2, weight, bias)]
            )
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T (+ b) with W [out_features, in_features] in the model's dtype or FP8 with row scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_parameter(
            "weight_scale", None
        )  # FP8 / int8 weights only: fp32 [out_features]
        self.register_buffer("input_scale", None)  # FP8 with a static activation scale: fp32 [1]
        self.quant = None  # group-wise int4 or W8A8 state owning the weights' matmul (layers/group_quant_linear.py)

    def _out_rows(self, shard_id: object) -> tuple[int, int, int]:
        """(first row in our weight, rows, first row in the checkpoint tensor) for a checkpoint part."""
        return 0, self.out_features, 0

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded)

    def full_in_features(self) -> int:
        """Input features of the unsharded layer (a row-parallel rank holds a slice of them)."""
        return self.in_features

    def full_rows(self, shard_id: object = None) -> int:
        """Output rows of a checkpoint part (None: the whole layer) in the unsharded model."""
        return self.out_features

    def lora_shard(
        self, shard_id: object, r: int, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """(first output row, rows, A, B) of a rank-r LoRA delta on this rank, from the unsharded A [r, full in] and
        B [full rows of the part, r]; ValueError naming the shapes that do not fit."""
        offset, size, start = self._out_rows(shard_id)
        full_in, rows = self.full_in_features(), self.full_rows(shard_id)
        if a.shape != (r, full_in) or b.shape != (rows, r):
            raise ValueError(
                f"A {list(a.shape)} and B {list(b.shape)}; the model's layer needs [{r}, {full_in}] and "
                f"[{rows}, {r}]"
            )
        if self.in_features != full_in:  # row-parallel: this rank's input columns
            a = a.narrow(1, get_tp_rank() * self.in_features, self.in_features)
        return offset, size, a, b.narrow(0, start, size)

    @property
    def is_fp8(self) -> bool:
        return self.weight is not None and self.weight.dtype == FP8

    @property
    def is_weight_only(self) -> bool:
        """int8 ([N, K]) or packed int4 (uint8 [N, K / 2]) weights with row scales; activations unquantized."""
        return self.quant is None and self.weight.dtype in (torch.int8, torch.uint8)

    def to_weight_only(self, bits: int) -> None:
        """Quantize the loaded weight to int8 or int4 with one scale per output row (weight-only)."""
        if not self.is_weight_only and self.quant is None:
            quantize = quantize_weight_int8 if bits == 8 else quantize_weight_int4
            self._set_quantized(*quantize(self.weight.data, self._row_amax()))

    def to_fp8(self) -> None:
        """Quantize the loaded weight to e4m3 with one scale per output row (dynamic activation scales)."""
        if not self.is_fp8 and self.quant is None:
            self._set_quantized(*quantize_weight(self.weight.data, self._row_amax()))

    def _row_amax(self) -> torch.Tensor | None:
        """A row-parallel shard's row maxima over the whole rows (a max over the tensor-parallel ranks: every rank
        then scales its slice as one process scales the row); None where this rank holds whole rows. Collective:
        every rank quantizes its layers in the same order."""
        if self.in_features == self.full_in_features():
            return None
        return tp_all_reduce(self.weight.data.float().abs().amax(dim=1), op="max")

    def make_fp8(self) -> None:
        """Hold an e4m3 weight and its scales, to be filled from a pre-quantized checkpoint."""
        if not self.is_fp8 and self.quant is None:
            w = self.weight
            self._set_quantized(
                torch.empty(w.shape, dtype=FP8, device=w.device),
                torch.ones(w.shape[0], dtype=torch.float32, device=w.device),
            )

    def _set_quantized(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold a quantized weight (e4m3 or int8) and its per-row scales."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.weight_scale.weight_loader = self.scale_loader

    def scale_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        """A weight scale per tensor (or per fused part: a scalar) or per output row ([rows] or [rows, 1])."""
        offset, size, start = self._out_rows(shard_id)
        rows = param.data.narrow(0, offset, size)
        if loaded.numel() == 1:
            rows.fill_(loaded.reshape(()))
        else:
            default_weight_loader(rows, loaded.reshape(-1).narrow(0, start, size))

    def load_input_scale(self, loaded: torch.Tensor) -> None:
        """A static activation scale; fused parts (q, k, v of one input) keep the largest."""
        value = loaded.detach().float().max().reshape(1).to(self.weight.device)
        self.input_scale = (
            value if self.input_scale is None else torch.maximum(self.input_scale, value)
        )

    def _matmul(self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.matmul(self, x, bias)
        if self.weight_scale is not None and self.is_weight_only:
            return weight_only_linear(x, self.weight, self.weight_scale, bias)
        if (
            self.weight_scale is not None
        ):  # FP8 weights; x may come quantized by the producing kernel
            return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias)
        return linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        return self._matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_size()
        assert out_features % tp == 0, f"{out_features} output features do not split over TP={tp}"
        super().__init__(in_features, out_features // tp, bias)

    def _out_rows(self, shard_id: object) -> tuple[int, int, int]:
        size = self.out_features
        return 0, size, get_tp_rank() * size

    def full_rows(self, shard_id: object = None) -> int:
        return self.out_features * get_tp_size()

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        offset, size, start = self._out_rows(shard_id)
        default_weight_loader(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate_proj + up_proj); shard_id = index."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def _out_rows(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id is None:
            return super()._out_rows(shard_id)
        tp = get_tp_size()
        size = self.output_sizes[shard_id] // tp
        return sum(self.output_sizes[:shard_id]) // tp, size, get_tp_rank() * size

    def full_rows(self, shard_id: object = None) -> int:
        return super().full_rows() if shard_id is None else self.output_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul; shard_id in {"q", "k", "v"}."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(
            1, num_kv_heads // tp
        )  # KV heads are replicated when fewer than ranks
        self._kv_replicas = max(1, tp // num_kv_heads)
        out = (num_heads + 2 * num_kv_heads * self._kv_replicas) * head_dim
        super().__init__(hidden_size, out, bias)

    def _out_rows(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id is None:
            return super()._out_rows(shard_id)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = get_tp_rank() if shard_id == "q" else get_tp_rank() // self._kv_replicas
        return offset, size, rank * size

    def full_rows(self, shard_id: object = None) -> int:
        if shard_id is None:
            return super().full_rows()
        heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        return (
            heads * get_tp_size() // (1 if shard_id == "q" else self._kv_replicas) * self.head_dim
        )


class RowParallelLinear(LinearBase):
    """Input features split across ranks; outputs summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        tp = get_tp_size()
        assert in_features % tp == 0, f"{in_features} input features do not split over TP={tp}"
        super().__init__(in_features // tp, out_features, bias)

    def full_in_features(self) -> int:
        return self.in_features * get_tp_size()

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if param.dim() == 1:  # bias: full on every rank, added once after the reduce
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, get_tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(self._matmul(x, None))
        return y + self.bias if self.bias is not None else y
