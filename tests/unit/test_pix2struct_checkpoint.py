"""Random Pix2Struct / DePlot checkpoints: config and special ids, transformers loads every tensor of the file, the VQA
processor draws the prompt offline (Pillow's built-in font) into flattened patches of the configured shape, greedy
generation depends on the picture, determinism, and the deplot preset's real shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    Pix2StructConfig,
    Pix2StructForConditionalGeneration,
)

from mmserve.models.pix2struct import builtin_font_bytes
from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.pix2struct import (
    DEPLOT_PROMPT,
    _param_specs,
    checkpoint_key,
    make_pix2struct_checkpoint,
    pix2struct_config,
    pix2struct_sizes,
    vqa_inputs,
)
from tests.checkpoint_files import file_tensors, files_digest, load_matching_the_file

PAD, EOS, UNK = 0, 1, 2  # every preset; PAD is also the decoder start
VOCAB, D, MAX_PATCHES, PATCH_DIM = 400, 64, 64, 4 * 4 * 3
LM_HEAD, EMBED = "decoder.lm_head.weight", "decoder.embed_tokens.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_pix2struct_checkpoint(
        tmp_path_factory.mktemp("pix2struct") / "tiny", progress=False
    )


@pytest.fixture(scope="module")
def loaded(ckpt):
    return Pix2StructForConditionalGeneration.from_pretrained(
        ckpt
    ).eval(), AutoProcessor.from_pretrained(ckpt)


def test_config_round_trip_and_special_ids(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    assert (
        raw["architectures"] == ["Pix2StructForConditionalGeneration"]
        and raw["model_type"] == "pix2struct"
    )
    assert raw["is_vqa"] is True and raw["tie_word_embeddings"] is False
    cfg = Pix2StructConfig.from_pretrained(ckpt)
    assert cfg.to_dict() == pix2struct_config().to_dict() | {
        "transformers_version": cfg.transformers_version
    }
    t, v = cfg.text_config, cfg.vision_config
    assert (cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id) == (PAD, PAD, EOS)
    assert (t.decoder_start_token_id, t.pad_token_id, t.eos_token_id, t.bos_token_id) == (
        PAD,
        PAD,
        EOS,
        None,
    )
    assert (t.vocab_size, t.hidden_size, t.num_layers, t.num_heads, t.d_kv, t.d_ff) == (
        VOCAB,
        D,
        2,
        4,
        16,
        128,
    )
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.d_kv, v.d_ff) == (
        D,
        2,
        4,
        16,
        128,
    )
    assert (v.patch_embed_hidden_size, v.seq_len) == (PATCH_DIM, 4096)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert (gen["decoder_start_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (
        PAD,
        EOS,
        PAD,
    )
    assert gen.get("bos_token_id") is None
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert len(tok) == VOCAB and tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id, tok.bos_token_id) == (
        PAD,
        EOS,
        UNK,
        None,
    )
    ids = tok("a cat").input_ids  # T5-style: no BOS, </s> appended
    assert (
        ids[-1] == EOS and PAD not in ids and tok.decode(ids, skip_special_tokens=True) == "a cat"
    )
    assert (
        tok.decode(tok("café 日本 🙂 12.5").input_ids, skip_special_tokens=True)
        == "café 日本 🙂 12.5"
    )


def test_transformers_loads_every_tensor_of_the_file(ckpt):
    model, state, on_disk = load_matching_the_file(
        Pix2StructForConditionalGeneration, ckpt, checkpoint_key
    )
    # encoder: patch projection (weight, bias), row and column tables, 9 per layer, the final norm;
    # decoder: embed_tokens, 14 per layer (+ layer 0's relative_attention_bias), final_layer_norm, lm_head
    assert len(on_disk) == len(state) == (4 + 2 * 9 + 1) + (1 + 2 * 14 + 1 + 1 + 1)
    assert {
        "encoder.embeddings.patch_projection.weight",
        "encoder.embeddings.patch_projection.bias",
        "encoder.embeddings.row_embedder.weight",
        "encoder.embeddings.column_embedder.weight",
        "encoder.encoder.layer.1.attention.query.weight",
        "encoder.encoder.layer.0.attention.output.weight",
        "encoder.encoder.layer.0.mlp.wi_0.weight",
        "encoder.encoder.layer.1.mlp.wo.weight",
        "encoder.encoder.layer.0.pre_attention_layer_norm.weight",
        "encoder.encoder.layer.1.pre_mlp_layer_norm.weight",
        "encoder.layernorm.weight",
        EMBED,
        LM_HEAD,
        "decoder.final_layer_norm.weight",
        "decoder.layer.0.self_attention.attention.relative_attention_bias.weight",
        "decoder.layer.1.self_attention.attention.key.weight",
        "decoder.layer.0.self_attention.layer_norm.weight",
        "decoder.layer.1.encoder_decoder_attention.attention.value.weight",
        "decoder.layer.0.encoder_decoder_attention.layer_norm.weight",
        "decoder.layer.1.mlp.DenseReluDense.wi_1.weight",
        "decoder.layer.0.mlp.layer_norm.weight",
    } <= on_disk.keys()
    assert not any("relative_attention_bias" in k for k in on_disk if ".layer.1." in k)
    assert on_disk[EMBED].shape == on_disk[LM_HEAD].shape == (VOCAB, D)
    assert not torch.equal(on_disk[EMBED], on_disk[LM_HEAD])
    assert model.decoder.lm_head.weight is not model.decoder.embed_tokens.weight  # not tied
    assert on_disk["encoder.embeddings.patch_projection.weight"].shape == (D, PATCH_DIM)
    assert on_disk["encoder.embeddings.row_embedder.weight"].shape == (4096, D)
    assert on_disk[
        "decoder.layer.0.self_attention.attention.relative_attention_bias.weight"
    ].shape == (32, 4)
    assert on_disk["decoder.layer.0.mlp.DenseReluDense.wo.weight"].shape == (D, 128)
    norms = torch.cat([t for k, t in on_disk.items() if k.endswith("norm.weight")])
    assert (
        abs(float(norms.mean()) - 1) < 0.05 and 0.05 < float(norms.std()) < 0.2
    )  # RMSNorm scales near 1
    assert {t.dtype for t in on_disk.values()} == {torch.float32}


def test_processor_draws_the_prompt_offline_with_the_builtin_font(ckpt, loaded):
    _, processor = loaded
    font = builtin_font_bytes()
    assert isinstance(font, bytes) and font[:4] == b"\x00\x01\x00\x00"  # a TrueType file
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Pix2StructImageProcessor" and pre["is_vqa"] is True
    assert (pre["max_patches"], pre["patch_size"], pre["do_normalize"]) == (
        64,
        {"height": 4, "width": 4},
        True,
    )
    assert type(processor).__name__ == "Pix2StructProcessor"
    enc = vqa_inputs(processor, make_test_image(0), DEPLOT_PROMPT, font_bytes=font)
    patches, mask = enc["flattened_patches"], enc["attention_mask"]
    assert set(enc) == {"flattened_patches", "attention_mask"}
    assert patches.shape == (1, MAX_PATCHES, 2 + PATCH_DIM) and mask.shape == (1, MAX_PATCHES)
    real = int(mask.sum())
    rows, cols = int(patches[0, :, 0].max()), int(patches[0, :, 1].max())
    assert (
        0 < real == rows * cols <= MAX_PATCHES and mask[0, :real].all() and not mask[0, real:].any()
    )
    assert patches[0, 0, :2].tolist() == [1, 1] and patches[0, real - 1, :2].tolist() == [
        rows,
        cols,
    ]
    assert not patches[0, real:].any()  # padding rows are zeros
    # the prompt is in the pixels: another prompt, other patches; the default font is the built-in one
    other = vqa_inputs(processor, make_test_image(0), "What is the highest value?")
    assert not torch.equal(other["flattened_patches"], patches)
    assert torch.equal(
        vqa_inputs(processor, make_test_image(0), DEPLOT_PROMPT)["flattened_patches"], patches
    )
    two = vqa_inputs(processor, [make_test_image(0), make_test_image(3, (90, 30))], DEPLOT_PROMPT)[
        "flattened_patches"
    ]
    assert two.shape == (2, MAX_PATCHES, 2 + PATCH_DIM) and torch.equal(two[:1], patches)


def test_the_stock_processor_call_matches_given_the_hub_font(loaded, tmp_path, monkeypatch):
    """``processor(images, text)`` draws the header in the Arial.TTF it fetches from the hub (``ybelkada/fonts``):
    with that file in the (offline) hub cache it gives what :func:`vqa_inputs` gives, once told the saved
    max_patches (Pix2StructProcessor's own default is 2048). Its ``font_bytes=`` keyword is dropped (transformers
    5.24), so without the cached font it goes to the hub."""
    from huggingface_hub import constants

    _, processor = loaded
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(Exception, match="(?i)offline|cache|connection"):
        processor(
            images=make_test_image(0),
            text=DEPLOT_PROMPT,
            return_tensors="pt",
            font_bytes=builtin_font_bytes(),
        )
    commit = "0" * 40
    repo = tmp_path / "models--ybelkada--fonts"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "Arial.TTF").write_bytes(builtin_font_bytes())
    stock = processor(
        images=make_test_image(0), text=DEPLOT_PROMPT, return_tensors="pt", max_patches=MAX_PATCHES
    )
    ours = vqa_inputs(processor, make_test_image(0), DEPLOT_PROMPT)
    assert stock.keys() == ours.keys() and all(torch.equal(stock[k], ours[k]) for k in ours)
    default = processor(images=make_test_image(0), text=DEPLOT_PROMPT, return_tensors="pt")
    assert default["flattened_patches"].shape == (
        1,
        2048,
        2 + PATCH_DIM,
    )  # still within seq_len 4096


def test_greedy_generate_depends_on_the_picture(loaded):
    model, processor = loaded
    outs, firsts = [], []
    for seed in (0, 1, 2):
        enc = vqa_inputs(processor, make_test_image(seed), DEPLOT_PROMPT)
        with torch.no_grad():
            outs.append(model.generate(**enc, max_new_tokens=8, do_sample=False)[0].tolist())
            firsts.append(model(**enc, decoder_input_ids=torch.tensor([[PAD]])).logits[0, -1])
    for out in outs:
        assert out[0] == PAD and len(out) == 1 + 8 and EOS not in out and len(set(out[1:])) >= 4
    assert outs[0] != outs[1] != outs[2] != outs[0]
    assert (firsts[0] - firsts[1]).abs().max() > 0.5 and firsts[
        0
    ].std() > 1.5  # logits spread, the image matters
    top = firsts[1].topk(2).values
    assert top[0] - top[1] > 0.1  # greedy is not a near-tie
    # the cached and the uncached decoding agree (the config's use_cache is False, as the real one)
    enc = vqa_inputs(processor, make_test_image(0), DEPLOT_PROMPT)
    with torch.no_grad():
        cached = model.generate(**enc, max_new_tokens=8, do_sample=False, use_cache=True)[
            0
        ].tolist()
    assert cached == outs[0]


def test_seed_determinism_sharding_and_dtype(tmp_path):
    kw = {"text_layers": 1, "progress": False}
    a = make_pix2struct_checkpoint(tmp_path / "a", seed=3, **kw)
    b = make_pix2struct_checkpoint(tmp_path / "b", seed=3, **kw)
    c = make_pix2struct_checkpoint(tmp_path / "c", seed=4, **kw)
    assert files_digest(a) == files_digest(b) != files_digest(c)
    for name in (
        "tokenizer.json",
        "config.json",
        "preprocessor_config.json",
        "processor_config.json",
    ):
        assert (a / name).read_bytes() == (c / name).read_bytes(), name
    d = make_checkpoint(
        "pix2struct", tmp_path / "d", seed=3, max_shard_bytes=400_000, layout="transformers", **kw
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    sharded, single = file_tensors(d), file_tensors(a)
    assert (
        len(set(index["weight_map"].values())) > 1
        and sharded.keys() == single.keys() == index["weight_map"].keys()
    )
    assert all(torch.equal(sharded[k], single[k]) for k in sharded)
    model, info = Pix2StructForConditionalGeneration.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()) and len(model.decoder.layer) == 1
    half = make_pix2struct_checkpoint(tmp_path / "e", seed=3, dtype="bfloat16", **kw)
    assert {t.dtype for t in file_tensors(half).values()} == {torch.bfloat16}


def test_deplot_preset_has_the_real_shapes():
    """google/deplot is pix2struct-base in VQA mode: the default Pix2Struct text and vision configs (width 768,
    12 + 12 layers, 12 heads of 64, d_ff 2048, 16x16 patches, vocab 50244), 282.3M parameters."""
    cfg = pix2struct_config("deplot")
    ref = Pix2StructConfig(is_vqa=True)
    ignore = {"dtype", "architectures", "_name_or_path", "transformers_version"}
    for ours, theirs in (
        (cfg.text_config, ref.text_config),
        (cfg.vision_config, ref.vision_config),
        (cfg, ref),
    ):
        a, b = ours.to_dict(), theirs.to_dict()
        skip = ignore | {"text_config", "vision_config"}  # compared one by one
        assert {k: v for k, v in a.items() if k not in skip} == {
            k: v for k, v in b.items() if k not in skip
        }
    assert str(cfg.text_config.dtype).endswith("bfloat16") and cfg.is_vqa
    specs = {name: shape for name, shape, _ in _param_specs(cfg)}
    assert specs[EMBED] == specs[LM_HEAD] == (50244, 768)
    assert specs["encoder.embeddings.patch_projection.weight"] == (768, 16 * 16 * 3)
    assert specs["decoder.layer.11.mlp.DenseReluDense.wi_0.weight"] == (2048, 768)
    assert sum(math.prod(v) for v in specs.values()) == 282_285_696
    assert pix2struct_sizes("deplot").max_patches == 2048


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown pix2struct preset"):
        pix2struct_config("pix2struct-large")
    with pytest.raises(TypeError, match="unknown pix2struct overrides"):
        pix2struct_config(num_layers=2)
    with pytest.raises(ValueError, match="must equal hidden"):
        pix2struct_config(text_heads=2)
    with pytest.raises(ValueError, match="must exceed max_patches"):
        pix2struct_config(seq_len=64)
    with pytest.raises(ValueError, match="layout"):
        make_pix2struct_checkpoint(tmp_path, layout="google")
