"""Random BLIP-2 checkpoints: transformers loads them, both layouts load into mmserve, presets have real shapes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoProcessor, Blip2ForConditionalGeneration

from mmserve.models.blip2 import Blip2ForConditionalGeneration as OurBlip2
from mmserve.models.loader import build_model
from mmserve.models.weights import iter_safetensors
from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.blip2 import _param_specs, blip2_config, blip2_sizes, make_blip2_checkpoint

TEXT_FFN_KEYS = ("intermediate.dense", "output.dense", "output.LayerNorm")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        layout: str(
            make_blip2_checkpoint(tmp_path_factory.mktemp(f"blip2_{layout}"), layout=layout)
        )
        for layout in ("transformers", "hub")
    }


def test_transformers_loads_the_tiny_checkpoint_with_no_missing_or_extra_tensors(tiny_dirs):
    model, info = Blip2ForConditionalGeneration.from_pretrained(
        tiny_dirs["transformers"], output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    cfg = model.config
    processor = AutoProcessor.from_pretrained(tiny_dirs["transformers"])
    enc = processor(
        text="Question: which city is this? Answer:",
        images=[make_test_image(0)],
        return_tensors="pt",
    )
    ids = enc["input_ids"][0].tolist()
    # the processor puts num_query_tokens image tokens before BOS; the vocab was sized after it added <image>
    assert ids[: cfg.num_query_tokens + 1] == [cfg.image_token_index] * cfg.num_query_tokens + [1]
    assert len(processor.tokenizer) <= cfg.text_config.vocab_size
    assert enc["pixel_values"].shape[-1] == cfg.vision_config.image_size


def test_hub_layout_adds_salesforce_extras_and_loads_the_same_model(tiny_dirs):
    _, info = Blip2ForConditionalGeneration.from_pretrained(
        tiny_dirs["hub"], output_loading_info=True
    )
    assert not info["missing_keys"]
    assert info["unexpected_keys"] and all(
        any(k in u for k in TEXT_FFN_KEYS) for u in info["unexpected_keys"]
    )
    names = {n for n, _ in iter_safetensors(tiny_dirs["hub"])}
    assert "language_model.lm_head.weight" in names
    cpu = torch.device("cpu")
    ours = {
        layout: build_model(d, blip2_config(), cpu, torch.float32)
        for layout, d in tiny_dirs.items()
    }
    a, b = ours["transformers"].state_dict(), ours["hub"].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours["hub"].qformer.layernorm.weight.dtype == torch.float32


def test_qformer_stays_fp32_in_a_half_precision_model(tiny_dirs):
    model = build_model(
        tiny_dirs["transformers"], blip2_config(), torch.device("cpu"), torch.bfloat16
    )
    assert (
        model.query_tokens.dtype == torch.float32
        and model.qformer.layernorm.weight.dtype == torch.float32
    )
    assert model.language_model.lm_head.weight.dtype == torch.bfloat16
    assert model.language_model.lm_head.weight is model.language_model.model.embed_tokens.weight


def test_make_checkpoint_dispatches_blip2_and_shards_deterministically(tmp_path):
    a = make_checkpoint("blip2", tmp_path / "a", max_shard_bytes=200_000)
    b = make_blip2_checkpoint(tmp_path / "b", max_shard_bytes=200_000)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert all((a / s).read_bytes() == (b / s).read_bytes() for s in shards)
    assert json.loads((a / "config.json").read_text())["architectures"] == [
        "Blip2ForConditionalGeneration"
    ]


def test_blip2_opt_2_7b_preset_has_the_published_shapes_and_maps_onto_our_model():
    cfg = blip2_config("blip2-opt-2.7b")
    t, v, q = cfg.text_config, cfg.vision_config, cfg.qformer_config
    assert (t.vocab_size, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.ffn_dim) == (
        50304,
        2560,
        32,
        32,
        10240,
    )
    assert (t.max_position_embeddings, t.word_embed_proj_dim, t.do_layer_norm_before) == (
        2048,
        2560,
        True,
    )
    assert (
        v.hidden_size,
        v.num_hidden_layers,
        v.num_attention_heads,
        v.intermediate_size,
        v.image_size,
    ) == (1408, 39, 16, 6144, 224)
    assert (q.hidden_size, q.num_hidden_layers, q.intermediate_size, q.encoder_hidden_size) == (
        768,
        12,
        3072,
        1408,
    )
    assert (cfg.num_query_tokens, cfg.image_token_index) == (32, 50265)
    # every tensor of the Salesforce layout lands on one of our parameters with its shape (meta: no memory)
    specs = _param_specs(cfg, blip2_sizes("blip2-opt-2.7b"), "hub")
    with torch.device("meta"):
        ours = OurBlip2(cfg)
        ours.load_weights((name, torch.empty(shape)) for name, shape, _ in specs)
    total = sum(p.numel() for p in ours.parameters())
    assert 3.7e9 < total < 3.9e9, total


def test_unknown_preset_and_override_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown blip2 preset"):
        blip2_config("blip2-flan-t5")
    with pytest.raises(TypeError, match="unknown blip2 overrides"):
        blip2_config(text_width=3)
    with pytest.raises(ValueError, match="layout"):
        make_blip2_checkpoint(tmp_path, layout="lavis")
