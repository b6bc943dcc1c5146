"""Group-wise int4 (W4A16) and W8A8 int8 states of a `LinearBase` (its `quant`), with weight loaders for the
published checkpoint tensors of every linear kind under tensor parallelism.

Group-wise int4 (`GroupInt4`): the layer holds
    qweight uint8 [N, K / 2]  q in 0..15 packed along K in blocks of 16 columns (group_int4.pack_nibbles_k;
                              K / 2 rounded up to a whole block),
    scales  fp16  [N, G]      one per output row and group of `group_size` input columns,
    qzeros  uint8 [N, G]      zero points (GPTQ's read 1..16),
    g_idx   int32 [K]         the group of each input column (GPTQ act-order, or shards not on group boundaries),
and computes y = x @ ((q - z[:, g]) * s[:, g])^T. Checkpoint tensors arrive as AutoAWQ GEMM ("awq": qweight,
qzeros, scales) or GPTQ ("gptq": the same and g_idx) write them (layers/group_int4.py has both layouts); each
loader narrows the packed tensor to this rank's output rows (`_out_rows`: the part of a fused QKV / gate+up layer)
and, row-parallel, to its input columns, then unpacks into the layout above. A row-parallel rank whose columns start
and end on group boundaries keeps its groups' scales; otherwise (act-order, or K / tp not a multiple of group_size)
it keeps every group's scales and its slice of g_idx, and the kernels look each column's group up (slower). Where
a rank's columns hold whole groups in a scattered order (act-order at one rank), `after_loading` sorts them by
group once the weights are in (`column_order`: x's columns are gathered in that order), and the fast kernels run.
`to_group_int4` quantizes a loaded weight the same way (round to nearest, `--quantization int4_g128`).

W8A8 (`W8A8`): int8 weight [N, K] with one fp32 scale per output row (`weight`, `weight_scale`: the names and
loaders of the FP8 path, as compressed-tensors "int-quantized" checkpoints store them); activations quantized per
token, dynamic and symmetric, multiplied int8 x int8 -> int32 (layers/w8a8_linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.distributed import get_tp_rank
from mmserve.kernels.fp8_format import QuantizedRows
from mmserve.layers.group_int4 import (
    AWQ_ORDER,
    PACK_BLOCK,
    group_index,
    pack_nibbles_k,
    quantize_groups,
    unpack_nibbles_k,
    unpack_words,
)
from mmserve.layers.w8a8_linear import w8a8_linear
from mmserve.layers.weight_only import quantize_weight_int8

GROUP_FORMATS = ("awq", "gptq", "rtn")


@dataclass(frozen=True)
class GroupInt4Spec:
    """How a layer's group-wise int4 weights arrive: `fmt` "awq" / "gptq" (checkpoint layouts) or "rtn" (quantized
    at load); `group_size` -1 is one group over all input features; `act_order`: GPTQ desc_act (g_idx permuted)."""

    fmt: str
    group_size: int = 128
    act_order: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in GROUP_FORMATS:
            raise ValueError(
                f"group-wise int4 format must be one of {GROUP_FORMATS}, got {self.fmt!r}"
            )


def _param(layer: nn.Module, name: str, value: torch.Tensor, loader) -> None:
    p = nn.Parameter(value, requires_grad=False)
    p.weight_loader = loader
    p.keeps_checkpoint_dtype = True  # int32-packed checkpoint tensors: the loader unpacks them
    layer.register_parameter(name, p)


class GroupInt4:
    """A layer's group-wise int4 weights (module docstring); made by `make_group_int4`."""

    def __init__(self, layer: nn.Module, spec: GroupInt4Spec) -> None:
        k, k_full, n = layer.in_features, layer.full_in_features(), layer.out_features
        gs = k_full if spec.group_size == -1 else spec.group_size
        if gs <= 0 or k_full % gs:
            raise ValueError(
                f"in_features {k_full} is not a multiple of group_size {spec.group_size}"
            )
        if k % 8:
            raise ValueError(f"group-wise int4 needs in_features per rank divisible by 8, got {k}")
        self.spec, self.group_size, self.groups_total = spec, gs, k_full // gs
        self.k0 = get_tp_rank() * k if k != k_full else 0  # this rank's first input column
        # whole groups on this rank: keep only their scales; else all groups and each column's group (g_idx). The
        # kernels read a block of 16 columns with one group unless they look groups up per column.
        self.uses_g_idx = spec.act_order or self.k0 % gs != 0 or k % gs != 0 or gs % PACK_BLOCK != 0
        self.g0, groups = (0, k_full // gs) if self.uses_g_idx else (self.k0 // gs, k // gs)
        self._g_idx_parts: set = set()
        device = layer.weight.device
        layer.register_parameter("weight", None)
        _param(
            layer,
            "qweight",
            torch.zeros(n, -(-k // PACK_BLOCK) * PACK_BLOCK // 2, dtype=torch.uint8, device=device),
            self._loader("qweight", layer),
        )
        _param(
            layer,
            "scales",
            torch.zeros(n, groups, dtype=torch.float16, device=device),
            self._loader("scales", layer),
        )
        _param(
            layer,
            "qzeros",
            torch.full((n, groups), 8, dtype=torch.uint8, device=device),
            self._loader("qzeros", layer),
        )
        layer.register_buffer("column_order", None)  # act-order sorted by group: `after_loading`
        g_idx = (group_index(k_full, gs)[self.k0 : self.k0 + k]).to(torch.int32).to(device)
        if (
            spec.fmt == "gptq"
        ):  # GPTQ checkpoints carry g_idx: checked (or, act-order, taken) at load
            _param(layer, "g_idx", g_idx, self._loader("g_idx", layer))
        else:
            layer.register_buffer("g_idx", g_idx)

    def matmul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from mmserve.layers.group_int4_linear import group_int4_linear

        if (
            layer.column_order is not None
        ):  # act-order sorted at load: x's columns in the weight's order
            x = x.index_select(-1, layer.column_order)
        g_idx = layer.g_idx if self.uses_g_idx else None
        return group_int4_linear(
            x, layer.qweight, layer.scales, layer.qzeros, self.group_size, g_idx, bias
        )

    def after_loading(self, layer: nn.Module) -> None:
        """Where this rank's columns hold whole groups in a scattered order (GPTQ act-order), sort them by group:
        the packed weight's columns are permuted once (within this rank's slice of K) and x's columns gathered in
        that order at run time, so the kernels read groups of consecutive columns instead of looking each
        column's group up. Other layouts keep g_idx (a row-parallel shard holding parts of groups)."""
        k, gs = layer.in_features, self.group_size
        if not self.uses_g_idx or gs % PACK_BLOCK or k % gs:
            return
        g_idx = layer.g_idx.data.long()
        order = torch.argsort(g_idx, stable=True)
        first = int(g_idx[order[0]])
        arange = torch.arange(k, device=g_idx.device)
        if not torch.equal(g_idx[order], first + arange // gs):
            return
        if not torch.equal(order, arange):
            q = unpack_nibbles_k(layer.qweight.data, k)[:, order]
            layer.qweight.data.copy_(pack_nibbles_k(q))
            layer.column_order = order
        # this rank's groups only, as without g_idx
        layer.scales.data = layer.scales.data.narrow(1, first, k // gs).contiguous()
        layer.qzeros.data = layer.qzeros.data.narrow(1, first, k // gs).contiguous()
        layer.g_idx.data = g_idx[order].to(torch.int32)
        self.uses_g_idx, self.g0 = False, first

    def _loader(self, leaf: str, layer: nn.Module):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
            self.load(layer, leaf, param, loaded, shard_id)

        return load

    def load(
        self, layer, leaf: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: object
    ) -> None:
        """Copy a checkpoint tensor's part for this rank (narrowed while packed, then unpacked on the device)."""
        k = layer.in_features
        offset, size, start = layer._out_rows(shard_id)
        where = f"{leaf} of a layer [{layer.full_rows(shard_id)}, {layer.full_in_features()}]"
        if leaf == "g_idx":
            return self._load_g_idx(
                param, loaded.narrow(0, self.k0, k).to(param.device), shard_id, where
            )
        groups = param.shape[1]
        n_dim = (
            0 if (leaf == "qweight" and self.spec.fmt == "gptq") else 1
        )  # packed along N: 8 columns a word
        packed_n = leaf in ("qzeros",) or (leaf == "qweight" and self.spec.fmt == "awq")
        if packed_n and (start % 8 or size % 8):
            raise ValueError(
                f"{where}: rows {start}..{start + size} of this rank do not start on a packed word"
            )
        t = loaded.narrow(1, start // 8, size // 8) if packed_n else loaded.narrow(1, start, size)
        if leaf == "qweight":  # K rows: AWQ [K, N / 8], GPTQ [K / 8, N]
            t = t.narrow(0, self.k0, k) if n_dim else t.narrow(0, self.k0 // 8, k // 8)
        else:
            t = t.narrow(0, self.g0, groups)
        t = t.to(param.device)
        if leaf == "scales":
            rows = t.t().to(param.dtype)
        elif leaf == "qzeros":
            order = AWQ_ORDER if self.spec.fmt == "awq" else tuple(range(8))
            rows = (unpack_words(t, order) + (1 if self.spec.fmt == "gptq" else 0)).t()
        elif self.spec.fmt == "awq":
            rows = pack_nibbles_k(unpack_words(t, AWQ_ORDER).t())
        else:
            rows = pack_nibbles_k(unpack_words(t.t().contiguous()))
        target = param.data.narrow(0, offset, size)
        if target.shape != rows.shape:
            raise ValueError(
                f"{where}: checkpoint part {list(loaded.shape)} does not fit {list(target.shape)}"
            )
        target.copy_(rows)

    def _load_g_idx(
        self, param: nn.Parameter, g_idx: torch.Tensor, shard_id: object, where: str
    ) -> None:
        g_idx = g_idx.to(torch.int32)
        if not self.uses_g_idx:  # groups in order: the checkpoint's must be k // group_size
            if not torch.equal(g_idx, param.data):
                raise ValueError(
                    f"{where}: g_idx is not k // group_size, but desc_act (act-order) is false"
                )
            return
        if self._g_idx_parts and not torch.equal(
            g_idx, param.data
        ):  # fused q/k/v or gate/up: one input order
            raise ValueError(
                f"{where}: the fused parts' act-order g_idx differ (part {shard_id!r})"
            )
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= self.groups_total:
            raise ValueError(f"{where}: g_idx values must lie in 0..{self.groups_total - 1}")
        param.data.copy_(g_idx)
        self._g_idx_parts.add(shard_id)

    def fill(
        self, layer: nn.Module, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
    ) -> None:
        """Set the weights from q [N, K], scales and zeros [N, G] (this rank's, in the layout's groups)."""
        layer.qweight.data.copy_(pack_nibbles_k(q))
        layer.scales.data.copy_(scales)
        layer.qzeros.data.copy_(zeros)


def make_group_int4(layer: nn.Module, spec: GroupInt4Spec) -> GroupInt4:
    """Replace the layer's weight with room for group-wise int4 weights arriving as `spec` says."""
    if layer.quant is None:
        layer.quant = GroupInt4(layer, spec)
    return layer.quant


def to_group_int4(layer: nn.Module, group_size: int = 128) -> None:
    """Quantize the loaded weight to group-wise int4, round to nearest with zero points (`--quantization
    int4_g128`); a row-parallel rank's columns must hold whole groups (ValueError naming the sizes otherwise)."""
    if layer.quant is not None or layer.is_fp8 or layer.is_weight_only:
        return
    k, full = layer.in_features, layer.full_in_features()
    if k % group_size or (k != full and (get_tp_rank() * k) % group_size):
        raise ValueError(
            f"group-wise int4 at load: in_features per rank {k} (of {full}) is not a multiple of group_size "
            f"{group_size}; use fewer tensor-parallel ranks or int4"
        )
    q, scales, zeros = quantize_groups(layer.weight.data, group_size)
    make_group_int4(layer, GroupInt4Spec("rtn", group_size)).fill(layer, q, scales, zeros)


class W8A8:
    """int8 weight [N, K] and fp32 per-row scale; activations quantized per token at run time, or by the kernel
    that produces them (QuantizedRows) where the layer takes whole rows."""

    def takes_quantized_rows(self, layer: nn.Module) -> bool:
        """Whether a producer may quantize this layer's input: a row-parallel shard's rows are scaled by the whole
        rows' maximum, a max over the ranks that a fused norm or activation does not take."""
        return layer.in_features == layer.full_in_features()

    def after_loading(self, layer: nn.Module) -> None:
        """Nothing to prepare: the checkpoint's layout is the one the kernels read."""

    def matmul(
        self, layer: nn.Module, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None
    ) -> torch.Tensor:
        whole = self.takes_quantized_rows(layer)
        return w8a8_linear(x, layer.weight, layer.weight_scale, bias, whole_rows=whole)


def make_w8a8(layer: nn.Module) -> None:
    """Hold an int8 weight and its per-row scales, to be filled from a compressed-tensors int-quantized checkpoint."""
    if layer.quant is None and not layer.is_fp8:
        w = layer.weight
        layer._set_quantized(
            torch.empty(w.shape, dtype=torch.int8, device=w.device),
            torch.ones(w.shape[0], dtype=torch.float32, device=w.device),
        )
        layer.quant = W8A8()


def to_w8a8(layer: nn.Module) -> None:
    """Quantize the loaded weight to int8 per output row (`--quantization w8a8`: no smoothing); row-parallel
    shards scale by the whole row's maximum (a collective, as `to_weight_only`)."""
    if layer.quant is None and not (layer.is_fp8 or layer.is_weight_only):
        layer._set_quantized(*quantize_weight_int8(layer.weight.data, layer._row_amax()))
        layer.quant = W8A8()
