"""Random CogVLM / CogVLM2 checkpoints: the published on-disk layout (config.json, index, tensor names, tokenizer
place), seeded weights, overrides, the v1/v2 rule, the prompt convention, and the eager reference that the parity
tests use as their oracle (runs, deterministic, the vision expert matters, positions follow the original rule)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import mmserve.testing as testing
from mmserve.testing import make_test_image
from mmserve.testing.cogvlm import (
    CHECKPOINT_WRITERS,
    chat_prompt,
    cogvlm2_config,
    cogvlm_config,
    cogvlm_sizes,
    cogvlm_version,
    image_rows,
    kv_heads,
    make_cogvlm2_checkpoint,
    make_cogvlm_checkpoint,
    prompt_ids,
    rope_base,
    tokenizer_dir,
)
from mmserve.testing.cogvlm_layout import inv_freq, param_specs
from tests.checkpoint_files import file_tensors, files_digest
from tests.parity.cogvlm_reference import (
    load_reference,
    preprocess,
    reference_greedy,
    reference_positions,
    reference_prompt,
    vision_expert_rows,
)

PROMPT = chat_prompt("What is in this image?")
CONFIG_KEYS = {
    "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "hidden_size",
    "initializer_range", "intermediate_size", "max_position_embeddings", "num_attention_heads",
    "num_hidden_layers", "rms_norm_eps", "template_version", "tie_word_embeddings", "torch_dtype", "use_cache",
    "vision_config", "vocab_size",
}  # fmt: skip
VISION_KEYS = {
    "dropout_prob", "hidden_act", "hidden_size", "image_size", "in_channels", "intermediate_size",
    "layer_norm_eps", "num_heads", "num_hidden_layers", "num_positions", "patch_size",
}  # fmt: skip
LAYER_NAMES = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.rotary_emb.inv_freq",
    "self_attn.language_expert_query_key_value.weight", "self_attn.vision_expert_query_key_value.weight",
    "self_attn.language_expert_dense.weight", "self_attn.vision_expert_dense.weight",
    *(f"mlp.{e}_mlp.{p}_proj.weight" for e in ("language", "vision") for p in ("gate", "up", "down")),
}  # fmt: skip
EVA_NAMES = {
    f"{m}.{k}"
    for m in ("input_layernorm", "attention.query_key_value", "attention.dense", "mlp.fc1", "mlp.fc2",
              "post_attention_layernorm")
    for k in ("weight", "bias")
}  # fmt: skip
VISION_NAMES = {
    "patch_embedding.proj.weight", "patch_embedding.proj.bias", "patch_embedding.cls_embedding",
    "patch_embedding.position_embedding.weight", "linear_proj.linear_proj.weight", "linear_proj.norm1.weight",
    "linear_proj.norm1.bias", "linear_proj.gate_proj.weight", "linear_proj.dense_h_to_4h.weight",
    "linear_proj.dense_4h_to_h.weight", "boi", "eoi",
}  # fmt: skip


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("cogvlm")
    return {1: make_cogvlm_checkpoint(root / "v1"), 2: make_cogvlm2_checkpoint(root / "v2")}


def expected_names(version: int, text_layers: int = 2, vision_layers: int = 2) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    names |= {f"model.layers.{n}.{k}" for n in range(text_layers) for k in LAYER_NAMES}
    names |= {f"model.vision.{k}" for k in VISION_NAMES}
    names |= {
        f"model.vision.transformer.layers.{n}.{k}" for n in range(vision_layers) for k in EVA_NAMES
    }
    if version == 2:
        names |= {"model.vision.conv.weight", "model.vision.conv.bias"}
        names |= {
            f"model.layers.{n}.self_attn.vision_expert_query_key_value.bias"
            for n in range(text_layers)
        }
    return names


@pytest.mark.parametrize("version", [1, 2])
def test_layout_on_disk_is_the_published_one(ckpts, version):
    d = ckpts[version]
    cfg = json.loads((d / "config.json").read_text())
    assert set(cfg) == CONFIG_KEYS | ({"num_multi_query_heads"} if version == 2 else set())
    assert cfg["architectures"] == ["CogVLMForCausalLM"] and cfg["template_version"] == "chat"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_cogvlm.CogVLMForCausalLM"
    assert set(cfg["vision_config"]) == VISION_KEYS and cfg["vision_config"]["hidden_act"] == "gelu"
    grid = cfg["vision_config"]["image_size"] // cfg["vision_config"]["patch_size"]
    assert cfg["vision_config"]["num_positions"] == grid * grid + 1
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(shards) >= 2 and sorted(set(index["weight_map"].values())) == shards
    tensors = file_tensors(d)
    assert set(index["weight_map"]) == set(tensors) == expected_names(version)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    qkv = cfg["hidden_size"] + 2 * kv_heads(cfg) * hd
    assert tensors["model.layers.0.self_attn.vision_expert_query_key_value.weight"].shape == (
        qkv,
        64,
    )
    assert torch.equal(
        tensors["model.layers.1.self_attn.rotary_emb.inv_freq"], inv_freq(hd, rope_base(cfg))
    )
    assert (
        tensors["model.vision.patch_embedding.position_embedding.weight"].shape[0]
        == grid * grid + 1
    )
    assert all(t.dtype == torch.float32 for t in tensors.values())
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["pad_token_id"]) == (1, 0 if version == 1 else 384)
    assert gen["eos_token_id"] == (2 if version == 1 else [2, 385]) == cfg["eos_token_id"]


def test_tokenizer_place_and_prompt_convention(ckpts, tmp_path):
    assert tokenizer_dir(ckpts[1]) == ckpts[1] / "tokenizer"  # v1 ships none: a sub-folder
    assert not (ckpts[1] / "tokenizer.json").exists() and (ckpts[2] / "tokenizer.json").is_file()
    assert tokenizer_dir(ckpts[2]) == ckpts[2]
    sibling = tmp_path / "vicuna"
    make_cogvlm_checkpoint(tmp_path / "ckpt", tokenizer_path=sibling)
    assert (sibling / "tokenizer.json").is_file() and not (tmp_path / "ckpt" / "tokenizer").exists()
    for version, pad in ((1, 0), (2, 384)):
        ref = load_reference(str(ckpts[version]))
        tok = ref.tokenizer
        assert (tok.bos_token_id, tok.pad_token_id) == (1, pad)
        text = tok.encode(PROMPT, add_special_tokens=False)
        ids, types, pixels = reference_prompt(ref, PROMPT, [make_test_image(1)])
        assert ids == [1] + [pad] * 6 + text and types == [0] + [1] * 6 + [0] * len(text)
        size = ref.config.vision_config["image_size"]
        assert pixels.shape == (3, size, size)
        assert prompt_ids(tok, PROMPT, None) == ([1, *text], [0] * (len(text) + 1))
    assert chat_prompt("Why?") == "Question: Why? Answer:"


def test_a_seed_gives_byte_identical_weights_and_the_experts_differ(ckpts, tmp_path):
    same = make_cogvlm_checkpoint(tmp_path / "same", progress=False)
    other = make_cogvlm_checkpoint(tmp_path / "other", seed=1)
    assert files_digest(same) == files_digest(ckpts[1]) != files_digest(other)
    for version in (1, 2):
        t = file_tensors(ckpts[version])
        for lang, vis in (("language_expert_query_key_value", "vision_expert_query_key_value"),
                          ("language_expert_dense", "vision_expert_dense")):  # fmt: skip
            a, b = (
                t[f"model.layers.0.self_attn.{lang}.weight"],
                t[f"model.layers.0.self_attn.{vis}.weight"],
            )
            assert not torch.equal(a, b)
        assert not torch.equal(t["model.layers.0.mlp.language_mlp.up_proj.weight"], t["model.layers.0.mlp.vision_mlp.up_proj.weight"])  # fmt: skip


def test_overrides_and_unknown_overrides(tmp_path):
    d = make_cogvlm2_checkpoint(tmp_path, text_layers=3, vision_layers=1, max_shard_bytes=1 << 30)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["vision_config"]["num_hidden_layers"] == 1
    assert [p.name for p in d.glob("*.safetensors")] == ["model.safetensors"]
    assert set(file_tensors(d)) == expected_names(2, 3, 1)
    assert cogvlm_config("tiny", text_hidden=96).hidden_size == 96
    with pytest.raises(TypeError, match="unknown cogvlm overrides"):
        cogvlm_config(text_size=3)
    with pytest.raises(ValueError, match="unknown cogvlm preset"):
        cogvlm_sizes("nope")
    with pytest.raises(ValueError, match="no GQA"):
        cogvlm_config(text_kv_heads=2)
    with pytest.raises(ValueError, match="even patch grid"):
        cogvlm2_config(image_size=42)


def test_versions_are_told_apart_and_real_presets_have_the_published_shapes():
    v1, v2 = cogvlm_config(), cogvlm2_config()
    assert v1.architectures == v2.architectures == ["CogVLMForCausalLM"]
    assert (cogvlm_version(v1), cogvlm_version(v2)) == (1, 2)
    assert (kv_heads(v1), kv_heads(v2), image_rows(v1), image_rows(v2)) == (4, 2, 6, 6)
    assert (rope_base(v1), rope_base(v2)) == (10000.0, 500000.0)
    assert cogvlm_config("tiny-v2").num_multi_query_heads == 2
    real1, real2 = cogvlm_config("cogvlm-chat-17b"), cogvlm2_config("cogvlm2-19b")
    assert (image_rows(real1), image_rows(real2)) == (1227, 2306)
    assert (real1.vision_config["num_positions"], real2.vision_config["num_positions"]) == (
        1226,
        9217,
    )
    assert (real1.vocab_size, real2.vocab_size, real2.intermediate_size) == (32000, 128256, 14336)
    # the published cogvlm2 config.json has no num_multi_query_heads (its class default 8 applies)
    published_v2 = {k: v for k, v in real2.to_dict().items() if k != "num_multi_query_heads"}
    assert (cogvlm_version(published_v2), kv_heads(published_v2)) == (2, 8)
    # every tensor of cogvlm2-llama3-chat-19B, in bf16: its model.safetensors.index.json total_size
    specs = param_specs(cogvlm_sizes("cogvlm2-19b"))
    assert 2 * sum(math.prod(shape) for _, shape, _ in specs) == 39006214656


def test_writers_are_registered():
    assert CHECKPOINT_WRITERS == {
        "cogvlm": make_cogvlm_checkpoint,
        "cogvlm2": make_cogvlm2_checkpoint,
    }
    assert testing.checkpoint_writers()["cogvlm2"] is make_cogvlm2_checkpoint


def test_positions_and_expert_rows_follow_the_original_rule():
    types = [0] + [1] * 6 + [0] * 3
    assert reference_positions(types) == [0, 1, 2, 2, 2, 2, 3, 4, 5, 6]
    assert vision_expert_rows(types) == [False] + [True] * 5 + [False] * 4
    assert reference_positions([0] * 4) == [0, 1, 2, 3] and not any(vision_expert_rows([0] * 4))
    assert reference_positions([0] + [1] * 4) == [0, 1, 2, 2, 3]  # an image at the end: eoi last
    assert vision_expert_rows([0] + [1] * 4) == [False, True, True, True, False]


@pytest.mark.parametrize("version", [1, 2])
def test_reference_runs_with_and_without_an_image_and_is_deterministic(ckpts, version):
    d = str(ckpts[version])
    image = make_test_image(3)
    with_image = reference_greedy(d, PROMPT, [image], 4)
    text_only = reference_greedy(d, PROMPT, None, 4)
    assert len(with_image[0]) == len(text_only[0]) + 6
    for ids, new, logprobs in (with_image, text_only):
        assert len(new) == 4 and logprobs.shape == (4, 392) and logprobs.dtype == torch.float32
        assert new == logprobs.argmax(-1).tolist()
        assert torch.isinf(logprobs[:, [2] + ([385] if version == 2 else [])]).all()
        assert torch.allclose(logprobs.exp().sum(-1), torch.ones(4), atol=1e-5)
    assert not torch.equal(with_image[2], text_only[2])
    load_reference.cache_clear()
    again = reference_greedy(d, PROMPT, [image], 4)
    assert again[:2] == with_image[:2] and torch.equal(again[2], with_image[2])
    with pytest.raises(ValueError, match="at most one image"):
        reference_greedy(d, PROMPT, [image, image], 1)


@pytest.mark.parametrize("version", [1, 2])
def test_the_vision_expert_matters_only_for_image_rows(ckpts, version):
    ref = load_reference(str(ckpts[version]))
    zeroed = {k: torch.zeros_like(v) if ".vision_expert_" in k or ".vision_mlp." in k else v
              for k, v in ref.weights.items()}  # fmt: skip
    no_vision_expert = dataclasses.replace(ref, weights=zeroed)
    for images, changes in (([make_test_image(5)], True), (None, False)):
        ids, types, pixels = reference_prompt(ref, PROMPT, images)
        a, b = ref.logits(ids, types, pixels), no_vision_expert.logits(ids, types, pixels)
        assert torch.equal(a, b) != changes


def test_preprocess_is_bicubic_resize_and_clip_normalize():
    image = make_test_image(7, (50, 30))
    x = preprocess(image, 28)
    assert x.shape == (3, 28, 28) and x.dtype == torch.float32
    from PIL import Image

    r, g, b = image.resize((28, 28), Image.BICUBIC).getpixel((5, 3))
    assert math.isclose(x[0, 3, 5].item(), (r / 255 - 0.48145466) / 0.26862954, rel_tol=1e-5)
    assert math.isclose(x[2, 3, 5].item(), (b / 255 - 0.40821073) / 0.27577711, rel_tol=1e-5)
