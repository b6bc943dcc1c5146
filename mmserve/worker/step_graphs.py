"""Capture of the language model's step graphs: decode graphs, whole-model graphs of small prefills and
piecewise graphs of the other steps, sharing one memory pool (CUDA + Triton attention backend only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mmserve.core.transfer import cdiv
from mmserve.worker.cross_kv import CrossKVPool
from mmserve.worker.cuda_graph import DecodeGraphs
from mmserve.worker.piecewise_graphs import PiecewiseGraphs
from mmserve.worker.prefill_graphs import PrefillGraphs, token_buckets


@dataclass(frozen=True)
class StepGraphShape:
    """The largest steps the graphs serve."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    # a cross-attention family's encoder tokens of one blank picture (the same on every rank); None: no picture
    cross_tokens: int | None = None


def capture_step_graphs(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    cross_kv: CrossKVPool | None,
    cross_backend,
    hidden_size: int,
    shape: StepGraphShape,
) -> tuple[DecodeGraphs | None, PrefillGraphs | None, PiecewiseGraphs | None]:
    """(decode, prefill, piecewise) graphs, captured; call after the KV pools are allocated. A cross-attention
    family gets decode graphs only, if it allows them (`family.cross_decode_graphs`), for decodes attending at
    most two pictures of `shape.cross_tokens` encoder tokens."""
    max_blocks = cdiv(shape.max_model_len, shape.block_size)
    family = model.family
    common = (model, device, shape.max_num_seqs, max_blocks, shape.block_size, shape.max_model_len)
    if family.cross_attention:
        if not family.cross_decode_graphs or shape.cross_tokens is None or cross_kv is None:
            return None, None, None
        decode = DecodeGraphs(
            *common,
            cross=cross_kv,
            cross_backend=cross_backend,
            cross_blocks=2 * cdiv(shape.cross_tokens, shape.block_size),
        )
        decode.capture()
        return decode, None, None
    decode = DecodeGraphs(*common, mrope=family.mrope)
    decode.capture()
    prefill = PrefillGraphs(
        model,
        device,
        dtype,
        hidden_size,
        shape.max_num_batched_tokens,
        max_blocks,
        shape.block_size,
        shape.max_model_len,
        family.mrope,
        pool=decode.pool,
    )
    prefill.capture()
    piecewise = PiecewiseGraphs(
        model,
        device,
        dtype,
        hidden_size,
        token_buckets(shape.max_num_batched_tokens),
        family.mrope,
        pool=decode.pool,
    )
    piecewise.capture()
    return decode, prefill, piecewise
