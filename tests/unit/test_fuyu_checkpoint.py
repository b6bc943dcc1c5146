"""Random Fuyu checkpoints: transformers loads both layouts with every tensor from the file, FuyuProcessor lays out
image prompts as the real model's, HF generates with and without an image, and the fuyu-8b preset has the real
shapes and token ids."""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoProcessor, AutoTokenizer, FuyuForCausalLM

from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.fuyu import (
    _param_specs,
    build_fuyu_tokenizer,
    checkpoint_key,
    fuyu_config,
    fuyu_sizes,
    image_grid,
    make_fuyu_checkpoint,
)
from tests.checkpoint_files import file_tensors, files_digest, load_matching_the_file

SPEAKER, NEWLINE, EOS, BOA, BOS, PAD = 400, 401, 402, 407, 1, 0  # tiny preset ids
SPACE = 223  # "Ġ": the leading space of a text span, alone
PROMPT = "What is this?\n"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuyu")
    return {
        layout: make_fuyu_checkpoint(root / layout, layout=layout)
        for layout in ("hub", "transformers")
    }


@pytest.fixture(scope="module")
def loaded(layouts):
    model = FuyuForCausalLM.from_pretrained(layouts["hub"]).eval()
    return model, AutoProcessor.from_pretrained(layouts["hub"])


def test_transformers_loads_both_layouts_with_every_tensor_from_the_file(layouts):
    for layout, d in layouts.items():
        _, state, on_disk = load_matching_the_file(
            FuyuForCausalLM, d, lambda n, layout=layout: checkpoint_key(n, layout)
        )
        assert (
            len(on_disk) == len(state) == 3 * 16 + 6
        )  # 16 per layer; embed, final norm (2), patch embed (2), head
    hub, tf = file_tensors(layouts["hub"]), file_tensors(layouts["transformers"])
    assert {
        "vision_embed_tokens.weight",
        "vision_embed_tokens.bias",
        "language_model.lm_head.weight",
        "language_model.model.embed_tokens.weight",
        "language_model.model.final_layernorm.bias",
        "language_model.model.layers.2.self_attn.query_key_value.weight",
    } <= hub.keys()
    assert {
        "model.vision_embed_tokens.weight",
        "lm_head.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.self_attn.q_layernorm.bias",
    } <= tf.keys()
    assert hub["vision_embed_tokens.weight"].shape == (80, 30 * 30 * 3)
    assert hub["language_model.model.layers.0.self_attn.query_key_value.weight"].shape == (240, 80)


def test_layouts_are_what_save_pretrained_writes(loaded, tmp_path):
    """transformers 5 saves adept's names by default ("hub"), its own with save_original_format=False."""
    model, _ = loaded
    for layout, original in (("hub", True), ("transformers", False)):
        model.save_pretrained(tmp_path / layout, save_original_format=original)
        with safe_open(str(tmp_path / layout / "model.safetensors"), "pt") as st:
            assert set(st.keys()) == {checkpoint_key(n, layout) for n in model.state_dict()}, layout


def test_norms_and_biases_are_not_trivial(loaded):
    """LayerNorm scales are ones (but the q/k LayerNorms'), every shift and linear bias is random: a missing bias
    or q/k norm changes the logits."""
    model, _ = loaded
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith(
            ("input_layernorm.weight", "post_attention_layernorm.weight", "final_layernorm.weight")
        ):
            assert bool((p == 1).all()), name
        elif name.endswith((".q_layernorm.weight", ".k_layernorm.weight")):
            assert p.shape == (20,) and 0.01 < (p - 1).abs().mean() < 0.5, name
        elif name.endswith(".bias"):
            assert 0.01 < p.abs().mean() < 0.5, name
    assert (
        sum(n.endswith(".bias") for n in params) == 3 * 8 + 2
    )  # 4 linears + 4 norms per layer, final, patches


def test_config_and_special_tokens(layouts, loaded):
    model, processor = loaded
    cfg, tok = model.config, processor.tokenizer
    t = cfg.text_config
    assert t.model_type == "persimmon" and t.hidden_act == "relu2" and t.qk_layernorm is True
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.intermediate_size) == (
        80,
        3,
        4,
        192,
    )
    assert model.model.language_model.layers[0].self_attn.head_dim == 20
    assert model.model.language_model.layers[0].self_attn.rotary_ndims == 10
    assert t.rope_parameters == {
        "rope_type": "default",
        "rope_theta": 25000.0,
        "partial_rotary_factor": 0.5,
    }
    assert (t.vocab_size, t.layer_norm_eps, cfg.patch_size, cfg.num_channels) == (408, 1e-5, 30, 3)
    assert (
        cfg.image_token_id == processor.image_token_id == SPEAKER
        and processor.image_newline_id == NEWLINE
    )
    assert len(tok) == t.vocab_size == 408  # as the real model: the tokenizer fills the vocab
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "|ENDOFTEXT|", "<unk>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS, EOS, PAD)
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (BOS, EOS, PAD)
    gen = json.loads((layouts["hub"] / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS, EOS, PAD)
    assert tok.convert_tokens_to_ids(["<0x00>", "<0x01>", "<0x02>", "<0x03>", "<0x04>"]) == [
        403,
        404,
        405,
        406,
        BOA,
    ]
    pre = json.loads((layouts["hub"] / "preprocessor_config.json").read_text())
    assert pre["size"] == {"height": 60, "width": 90} and pre["patch_size"] == {
        "height": 30,
        "width": 30,
    }


def test_tokenizer_spaces_and_byte_tokens(layouts):
    tok = AutoTokenizer.from_pretrained(layouts["hub"])
    # SentencePiece style: each text span starts with a space; the image rows stay whole after it
    assert tok("hello").input_ids[0] == BOS and tok.decode(tok("hello").input_ids[1:]) == " hello"
    assert tok("|SPEAKER||SPEAKER||NEWLINE|<s>", add_special_tokens=False).input_ids == [
        SPACE,
        SPEAKER,
        SPEAKER,
        NEWLINE,
        BOS,
    ]
    # beginning of answer: written out (what FuyuProcessor appends) or as the character (vLLM's way)
    assert (
        tok("hi<0x04>", add_special_tokens=False).input_ids
        == tok("hi\x04", add_special_tokens=False).input_ids
    )
    assert tok("hi\x04", add_special_tokens=False).input_ids[-1] == BOA
    assert (
        tok.decode(tok("café 日本 🙂|ENDOFTEXT|").input_ids, skip_special_tokens=True)
        == " café 日本 🙂"
    )
    # Fuyu has no chat template: this one writes each message's text and a newline, nothing for images
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    ]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == PROMPT
    two = [
        *messages,
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "Colour?"},
    ]
    assert tok.apply_chat_template(two, tokenize=False) == "What is this?\nA square.\nColour?\n"


def test_processor_lays_out_one_image_and_text(loaded):
    model, processor = loaded
    assert processor.chat_template is None  # FuyuProcessor.__init__ drops it; the tokenizer has it
    enc = processor(text=PROMPT, images=make_test_image(0), return_tensors="pt")
    assert set(enc) == {"input_ids", "attention_mask", "image_patches"}
    ids = enc["input_ids"][0].tolist()
    # 48x40 px (no resize: smaller than the 90x60 canvas) -> 2 rows x 2 cols of 30 px patches
    assert image_grid(fuyu_sizes(), 48, 40) == (2, 2)
    text = processor.tokenizer(PROMPT, add_special_tokens=False).input_ids
    assert text[0] == SPACE
    assert ids == [SPEAKER, SPEAKER, NEWLINE, SPEAKER, SPEAKER, NEWLINE, BOS, *text, BOA]
    assert enc["attention_mask"].tolist() == [[1] * len(ids)]
    patches = enc["image_patches"]
    assert (
        patches.shape == (4, 2700) and patches.dtype == torch.float32
    )  # [patches of all images, 30*30*3]
    # a patch is (row, col, channel)-major over the normalized 30x30 crop; the image is padded with 1/255
    pixels = processor.image_processor([make_test_image(0)], return_tensors="pt")["images"][0, 0]
    assert pixels.shape == (3, 60, 90)
    assert torch.allclose(patches[1], pixels[:, 0:30, 30:60].permute(1, 2, 0).reshape(-1))
    assert torch.allclose(pixels[:, 45, 70], torch.full((3,), (1 / 255 - 0.5) / 0.5))

    # 200x100 px: shrunk to 90x45 -> 2 rows x 3 cols
    big = processor(text=PROMPT, images=make_test_image(1, (200, 100)), return_tensors="pt")
    ids = big["input_ids"][0].tolist()
    assert image_grid(fuyu_sizes(), 200, 100) == (2, 3) and big["image_patches"].shape == (6, 2700)
    assert ids[:9] == [SPEAKER] * 3 + [NEWLINE] + [SPEAKER] * 3 + [NEWLINE, BOS] and ids[-1] == BOA
    # text only: the tokenizer's ids, no <0x04>
    only = processor(text=PROMPT, return_tensors="pt")
    assert only["input_ids"][0].tolist() == [BOS, *text] and set(only) == {
        "input_ids",
        "attention_mask",
    }
    # the same patches named pixel_values, which newer forwards take in place of the deprecated image_patches
    if "return_legacy_image_output" not in inspect.signature(processor.__call__).parameters:
        pytest.skip(
            "transformers 5.17's FuyuProcessor has no return_legacy_image_output (image_patches only)"
        )
    new = processor(
        text=PROMPT,
        images=make_test_image(0),
        return_tensors="pt",
        return_legacy_image_output=False,
    )
    assert set(new) == {"input_ids", "attention_mask", "pixel_values"} and torch.equal(
        new["pixel_values"], patches
    )


def test_the_image_matters(loaded):
    model, processor = loaded
    logits = []
    for seed in (0, 3):
        with torch.no_grad():
            enc = processor(text=PROMPT, images=make_test_image(seed), return_tensors="pt")
            logits.append(model(**enc).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-2
    assert logits[0].std() > 0.5  # spread out: greedy decoding is not a near-tie


def test_greedy_generate_with_and_without_an_image(loaded):
    model, processor = loaded
    inputs = [
        processor(text=PROMPT, images=make_test_image(0), return_tensors="pt"),
        processor(text="Describe a red square.", return_tensors="pt"),
    ]
    for enc in inputs:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        n = enc["input_ids"].shape[1]
        assert out.shape == (1, n + 8) and bool((out[0, n:] < 408).all())


def test_seed_determinism_and_sharding(tmp_path):
    kw = {"text_layers": 2}
    a = make_fuyu_checkpoint(tmp_path / "a", seed=3, **kw)
    b = make_fuyu_checkpoint(tmp_path / "b", seed=3, **kw)
    c = make_fuyu_checkpoint(tmp_path / "c", seed=4, **kw)
    assert files_digest(a) == files_digest(b) != files_digest(c)
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    d = make_checkpoint(
        "fuyu", tmp_path / "d", seed=3, max_shard_bytes=100_000, layout="transformers", **kw
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((d / "config.json").read_text())["architectures"] == ["FuyuForCausalLM"]
    sharded, single = file_tensors(d), file_tensors(a)
    assert {checkpoint_key(k) for k in sharded} == single.keys()
    assert all(torch.equal(sharded[k], single[checkpoint_key(k)]) for k in sharded)


def test_fuyu_8b_preset_has_the_real_shapes():
    cfg = fuyu_config("fuyu-8b")
    t = cfg.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.intermediate_size) == (
        4096,
        36,
        64,
        16384,
    )
    assert (t.vocab_size, t.max_position_embeddings, t.layer_norm_eps) == (262144, 16384, 1e-5)
    assert t.rope_parameters == {
        "rope_type": "default",
        "rope_theta": 25000.0,
        "partial_rotary_factor": 0.5,
    }
    assert t.hidden_act == "relu2" and t.qk_layernorm is True and t.tie_word_embeddings is False
    assert (cfg.image_size, cfg.patch_size, cfg.num_channels, cfg.image_token_id) == (
        300,
        30,
        3,
        71011,
    )
    assert str(t.dtype).endswith("bfloat16")
    specs = {name: shape for name, shape, _ in _param_specs(cfg, fuyu_sizes("fuyu-8b"))}
    assert (
        specs["model.language_model.embed_tokens.weight"]
        == specs["lm_head.weight"]
        == (262144, 4096)
    )
    assert specs["model.vision_embed_tokens.weight"] == (4096, 2700)
    assert specs["model.language_model.layers.35.self_attn.query_key_value.weight"] == (12288, 4096)
    assert sum(math.prod(s) for s in specs.values()) == 9_408_238_592  # adept/fuyu-8b: 9.41B


def test_fuyu_8b_tokenizer_has_the_real_special_ids():
    tok = build_fuyu_tokenizer(fuyu_sizes("fuyu-8b"))
    assert tok.convert_tokens_to_ids(["|SPEAKER|", "|NEWLINE|", "<0x04>"]) == [71011, 71019, 71122]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 71013, 0) and len(
        tok
    ) == 71123
    assert tok("|SPEAKER||NEWLINE|<s>", add_special_tokens=False).input_ids[1:] == [71011, 71019, 1]


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown fuyu preset"):
        fuyu_config("fuyu-heavy")
    with pytest.raises(TypeError, match="unknown fuyu overrides"):
        fuyu_config(num_layers=2)
    with pytest.raises(ValueError, match="must divide"):
        fuyu_config(text_heads=3)
    with pytest.raises(ValueError, match="multiples of patch_size"):
        fuyu_config(image_height=50)
    with pytest.raises(ValueError, match="layout"):
        make_fuyu_checkpoint(tmp_path, layout="adept")
