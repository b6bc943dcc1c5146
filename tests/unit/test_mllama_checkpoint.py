"""Random Llama-3.2-Vision (Mllama) checkpoints: transformers loads both layouts with every tensor from the file,
the processor gives Mllama's inputs, the gates let the image through, and the 11B preset has the real shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoProcessor, AutoTokenizer, MllamaForConditionalGeneration

from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.mllama import (
    GATES,
    _param_specs,
    build_mllama_tokenizer,
    checkpoint_key,
    make_mllama_checkpoint,
    mllama_config,
    mllama_sizes,
    patches_per_tile,
)
from tests.checkpoint_files import file_tensors, files_digest, load_matching_the_file

IMAGE, BOS, EOT, PAD = 416, 400, 409, 404  # tiny preset ids
CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mllama")
    return {
        layout: make_mllama_checkpoint(root / layout, layout=layout)
        for layout in ("hub", "transformers")
    }


@pytest.fixture(scope="module")
def loaded(layouts):
    model = MllamaForConditionalGeneration.from_pretrained(layouts["hub"]).eval()
    return model, AutoProcessor.from_pretrained(layouts["hub"])


def test_transformers_loads_both_layouts_with_every_tensor_from_the_file(layouts):
    for layout, d in layouts.items():
        _, state, on_disk = load_matching_the_file(
            MllamaForConditionalGeneration, d, lambda n, layout=layout: checkpoint_key(n, layout)
        )
        assert len(on_disk) == len(state)
    assert "language_model.model.layers.1.cross_attn_attn_gate" in file_tensors(layouts["hub"])
    assert "model.language_model.layers.1.cross_attn_attn_gate" in file_tensors(
        layouts["transformers"]
    )


def test_layouts_are_what_save_pretrained_writes(loaded, tmp_path):
    """transformers 5 saves the meta-llama names by default ("hub"), its own with save_original_format=False."""
    model, _ = loaded
    for layout, original in (("hub", True), ("transformers", False)):
        model.save_pretrained(tmp_path / layout, save_original_format=original)
        with safe_open(str(tmp_path / layout / "model.safetensors"), "pt") as st:
            assert set(st.keys()) == {checkpoint_key(n, layout) for n in model.state_dict()}, layout


def test_config_and_special_tokens(layouts, loaded):
    model, processor = loaded
    cfg, tok = model.config, processor.tokenizer
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (
        80,
        5,
        4,
        2,
    )
    assert t.cross_attention_layers == [1, 3] and t.rope_parameters["rope_type"] == "llama3"
    assert (v.hidden_size, v.attention_heads, v.num_hidden_layers, v.num_global_layers) == (
        32,
        2,
        3,
        2,
    )
    assert (v.image_size, v.patch_size, v.max_num_tiles, v.intermediate_layers_indices) == (
        28,
        14,
        4,
        [0, 2],
    )
    assert v.vision_output_dim == 96 and len(v.supported_aspect_ratios) == 8
    assert (
        model.model.vision_model.num_patches == patches_per_tile(mllama_sizes()) == 5
    )  # padded to 8 inside
    # <|image|> is the first id past the text vocab: embed_tokens has its row (+8), lm_head cannot produce it
    assert (
        cfg.image_token_index
        == tok.image_token_id
        == processor.image_token_id
        == t.vocab_size
        == IMAGE
    )
    assert model.model.language_model.embed_tokens.weight.shape[0] == IMAGE + 8
    assert model.lm_head.weight.shape[0] == IMAGE and len(tok) == IMAGE + 1
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    )
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOT, PAD)
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (BOS, [401, 408, EOT], PAD)
    gen = json.loads((layouts["hub"] / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (
        BOS,
        [401, 408, EOT],
        PAD,
    )
    assert tok.convert_ids_to_tokens([406, 407, 410, 411, 415]) == [
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|python_tag|>",
        "<|reserved_special_token_3|>",
        "<|reserved_special_token_7|>",
    ]
    assert tok("hi").input_ids[0] == BOS
    for special in ("<|image|>", "<|eot_id|>", "<|start_header_id|>"):
        assert (
            tok(f"a{special}b", add_special_tokens=False).input_ids.count(
                tok.convert_tokens_to_ids(special)
            )
            == 1
        )
    assert tok.decode(tok("café 日本 🙂").input_ids, skip_special_tokens=True) == "café 日本 🙂"


def test_chat_template(layouts):
    tok = AutoTokenizer.from_pretrained(layouts["hub"])
    messages = [
        *CHAT,
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "Colour?"},
    ]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|start_header_id|>user<|end_header_id|>\n\n<|image|>What is this?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA square.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nColour?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    two = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"}],
        }
    ]
    assert tok.apply_chat_template(two, tokenize=False) == (
        "<|start_header_id|>user<|end_header_id|>\n\n<|image|><|image|>Compare<|eot_id|>"
    )


def test_processor_outputs_for_one_image(loaded):
    model, processor = loaded
    prompt = processor.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    enc = processor(text=prompt, images=[make_test_image(0)], return_tensors="pt")
    assert set(enc) == {
        "input_ids",
        "attention_mask",
        "pixel_values",
        "aspect_ratio_ids",
        "aspect_ratio_mask",
        "cross_attention_mask",
    }  # num_tiles is the image processor's, the processor drops it
    ids = enc["input_ids"][0].tolist()
    n = len(ids)
    assert ids.count(IMAGE) == 1
    # the tokenizer adds BOS and MllamaProcessor inserts one more into a prompt without it
    assert ids[:3] == [BOS, BOS, 406]
    assert enc["pixel_values"].shape == (1, 1, 4, 3, 28, 28)  # [batch, images, max tiles, C, H, W]
    # 48x40 px on 28 px tiles: a 2x2 layout, id 6 of [[1,1],[1,2],[1,3],[1,4],[2,1],[2,2],[3,1],[4,1]] (1-based)
    assert enc["aspect_ratio_ids"].tolist() == [[6]] and enc["aspect_ratio_mask"].tolist() == [
        [[1, 1, 1, 1]]
    ]
    cam = enc["cross_attention_mask"]
    assert cam.shape == (1, n, 1, 4)
    first = ids.index(
        IMAGE
    )  # text from the image token on sees the image's tiles; earlier text sees nothing
    assert cam[0, :first].sum() == 0 and bool((cam[0, first:] == 1).all())

    small = processor.image_processor([make_test_image(1, (20, 16))], return_tensors="pt")
    assert small["num_tiles"] == [[1]] and small["aspect_ratio_ids"].tolist() == [[1]]
    assert (
        small["aspect_ratio_mask"].tolist() == [[[1, 0, 0, 0]]]
        and not small["pixel_values"][0, 0, 1:].any()
    )
    two = processor(
        text="<|image|>Left. <|image|>Right?",
        images=[make_test_image(1, (20, 16)), make_test_image(2)],
        return_tensors="pt",
    )
    ids = two["input_ids"][0].tolist()
    assert ids.count(IMAGE) == 2 and ids[:3] == [
        BOS,
        IMAGE,
        BOS,
    ]  # BOS goes after leading image tokens
    assert two["pixel_values"].shape == (1, 2, 4, 3, 28, 28)
    second = ids.index(IMAGE, ids.index(IMAGE) + 1)
    cam = two["cross_attention_mask"][0]
    assert cam[1:second].tolist() == [[[1, 0, 0, 0], [0, 0, 0, 0]]] * (
        second - 1
    )  # image 1: 1 tile
    assert cam[second:].tolist() == [[[0, 0, 0, 0], [1, 1, 1, 1]]] * (len(ids) - second)


def test_gates_are_open_so_the_image_matters(loaded):
    model, processor = loaded
    gates = {n: p.item() for n, p in model.named_parameters() if n.endswith(GATES)}
    assert len(gates) == 2 * 2 + 3 + 2 * 2  # 2 per cross layer, 3 vision, 2 per global layer
    assert all(g != 0 for g in gates.values()), gates
    prompt = processor.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    logits = []
    for image in (make_test_image(0), make_test_image(3)):
        with torch.no_grad():
            logits.append(
                model(**processor(text=prompt, images=[image], return_tensors="pt")).logits[0, -1]
            )
    assert (logits[0] - logits[1]).abs().max() > 1e-2


def test_greedy_generate_with_and_without_an_image(loaded):
    model, processor = loaded
    prompt = processor.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    inputs = [
        processor(text=prompt, images=[make_test_image(0)], return_tensors="pt"),
        processor(text="Describe a red square.", return_tensors="pt"),
    ]
    for enc in inputs:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        n = enc["input_ids"].shape[1]
        assert out.shape == (1, n + 8) and bool((out[0, n:] < IMAGE).all())


def test_seed_determinism_and_sharding(tmp_path):
    kw = {
        "text_layers": 2,
        "cross_attention_layers": [1],
        "vision_layers": 2,
        "vision_global_layers": 1,
        "intermediate_layers_indices": [0],
    }
    a = make_mllama_checkpoint(tmp_path / "a", seed=3, **kw)
    b = make_mllama_checkpoint(tmp_path / "b", seed=3, **kw)
    c = make_mllama_checkpoint(tmp_path / "c", seed=4, **kw)
    assert files_digest(a) == files_digest(b) != files_digest(c)
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    d = make_checkpoint("mllama", tmp_path / "d", seed=3, max_shard_bytes=100_000, **kw)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((d / "config.json").read_text())["architectures"] == [
        "MllamaForConditionalGeneration"
    ]
    sharded, single = file_tensors(d), file_tensors(a)
    assert sharded.keys() == single.keys() and all(
        torch.equal(sharded[k], single[k]) for k in single
    )


def test_llama_3_2_11b_vision_preset_has_the_real_shapes():
    cfg = mllama_config("llama-3.2-11b-vision")
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (
        4096,
        40,
        32,
        8,
    )
    assert (t.intermediate_size, t.vocab_size, t.max_position_embeddings) == (14336, 128256, 131072)
    assert t.cross_attention_layers == [3, 8, 13, 18, 23, 28, 33, 38]
    assert t.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (
        128000,
        [128001, 128008, 128009],
        128004,
    )
    assert (v.hidden_size, v.attention_heads, v.num_hidden_layers, v.num_global_layers) == (
        1280,
        16,
        32,
        8,
    )
    assert (v.image_size, v.patch_size, v.max_num_tiles, v.intermediate_size) == (560, 14, 4, 5120)
    assert v.intermediate_layers_indices == [3, 7, 15, 23, 30] and v.vision_output_dim == 7680
    assert v.supported_aspect_ratios == [
        [1, 1],
        [1, 2],
        [1, 3],
        [1, 4],
        [2, 1],
        [2, 2],
        [3, 1],
        [4, 1],
    ]
    assert cfg.image_token_index == 128256 and str(t.dtype).endswith("bfloat16")
    specs = {
        name: shape for name, shape, _, _ in _param_specs(cfg, mllama_sizes("llama-3.2-11b-vision"))
    }
    assert specs["model.language_model.embed_tokens.weight"] == (128264, 4096)
    assert specs["lm_head.weight"] == (128256, 4096)
    assert (
        sum(math.prod(s) for s in specs.values()) == 10_670_220_835
    )  # as meta-llama/Llama-3.2-11B-Vision


def test_11b_tokenizer_has_the_real_special_ids():
    tok = build_mllama_tokenizer(mllama_sizes("llama-3.2-11b-vision"))
    assert len(tok) == 128257 and tok.image_token_id == 128256
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (128000, 128009, 128004)
    assert tok.convert_ids_to_tokens([128006, 128007, 128010, 128255]) == [
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|python_tag|>",
        "<|reserved_special_token_247|>",
    ]


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown mllama preset"):
        mllama_config("llama-3.2-90b-vision")
    with pytest.raises(TypeError, match="unknown mllama overrides"):
        mllama_config(cross_layers=[1])
    with pytest.raises(ValueError, match="cross_attention_layers"):
        mllama_config(text_layers=2)
    with pytest.raises(ValueError, match="layout"):
        make_mllama_checkpoint(tmp_path, layout="meta")
