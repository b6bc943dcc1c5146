"""GPTQ act-order (desc_act: g_idx scattered over the input columns) sorted by group once the weights are loaded
(GroupInt4.after_loading): each decoder layer's packed columns permuted within its own K, x's columns gathered in
that order, and the kernels' fast path without a per-column group lookup.

Oracles: the weights the checkpoint stands for, dequantized from its own tensors with its g_idx (before any
reorder), give each layer's output up to fp32 summation order; the served model gives the fp32 model holding those
dequantized weights its logits (atol 1e-4, as tests/parity/test_int_checkpoints.py) and the same greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from mmserve import LLM
from mmserve.layers.group_int4 import dequantize_groups, unpack_gptq
from mmserve.models.quantization import after_loading, decoder_linears
from mmserve.testing.llava import make_llava_checkpoint
from mmserve.testing.quantized import write_quantized_checkpoint
from tests.parity.fp8_case import PARAMS, PROMPT


@pytest.fixture(scope="module")
def act_order(tmp_path_factory) -> tuple[Path, Path]:
    """(GPTQ act-order checkpoint with groups of 64, its dequantized fp32 twin) of a tiny LLaVA (widths 128, 256)."""
    root = tmp_path_factory.mktemp("gptq_act_order")
    src = make_llava_checkpoint(root / "src", seed=3, text_hidden=128, text_intermediate=256)
    dst, deq = root / "gptq", root / "gptq-dequantized"
    write_quantized_checkpoint(src, dst, "gptq", group_size=64, act_order=True, dequantized_dst=deq)
    return dst, deq


@pytest.fixture(scope="module")
def llm(act_order) -> LLM:
    return LLM(str(act_order[0]), device="cpu", dtype="float32")


def _checkpoint_weight(ckpt: Path, name: str) -> torch.Tensor:
    """A decoder projection's W [N, K] from the checkpoint's GPTQ tensors, dequantized with its g_idx."""
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        t = {
            leaf: f.get_tensor(f"{name}.{leaf}")
            for leaf in ("qweight", "qzeros", "scales", "g_idx")
        }
    q, z, s, g_idx = unpack_gptq(**t)
    assert not bool((g_idx[1:] >= g_idx[:-1]).all())  # act-order: not monotone
    return dequantize_groups(q, s, z, 64, g_idx)


def test_act_order_layers_are_sorted_by_group_and_skip_the_lookup(llm):
    layers = dict(decoder_linears(llm.engine.model))
    assert len(layers) == 3 * 4
    for name, layer in layers.items():
        k = layer.in_features
        order = layer.column_order
        assert order is not None and not torch.equal(order, torch.arange(k)), name
        assert torch.equal(order.sort().values, torch.arange(k)), (
            name
        )  # a permutation of its own columns
        assert layer.quant.uses_g_idx is False, name
        assert layer.scales.shape == (layer.out_features, k // 64), name
        assert torch.equal(layer.g_idx.long(), torch.arange(k) // 64), name
    after_loading(llm.engine.model)  # a second call changes nothing
    assert all(torch.equal(m.column_order, layers[n].column_order) for n, m in layers.items())


def test_each_sorted_layer_equals_its_checkpoint_weights(llm, act_order):
    """o_proj and down_proj hold one checkpoint tensor each: the sorted layer's output against x @ W^T with W
    dequantized from the checkpoint's own (unsorted) tensors and g_idx."""
    g = torch.Generator().manual_seed(0)
    layers = dict(decoder_linears(llm.engine.model))
    for leaf, parent in (("o_proj", "self_attn"), ("down_proj", "mlp")):
        ours = layers[f"model.layers.1.{parent}.{leaf}"]
        w = _checkpoint_weight(act_order[0], f"language_model.model.layers.1.{parent}.{leaf}")
        x = torch.randn(5, w.shape[1], generator=g)
        torch.testing.assert_close(ours(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_sorted_model_gives_the_dequantized_models_logits(llm, act_order):
    got = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    exact = LLM(str(act_order[1]), device="cpu", dtype="float32").generate(
        [PROMPT], PARAMS, use_tqdm=False
    )[0]
    assert got.outputs[0].token_ids == exact.outputs[0].token_ids
    torch.testing.assert_close(got.context_logits, exact.context_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.generation_logits, exact.generation_logits, atol=1e-4, rtol=1e-4)
