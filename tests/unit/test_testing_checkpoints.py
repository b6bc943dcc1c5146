"""Tests for mmserve.testing: tiny llava checkpoints load in transformers, are deterministic and well formed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmserve.testing import (
    DEMO_SUBDIR,
    build_bpe_tokenizer,
    checkpoint_key,
    default_model_dir,
    image_to_data_uri,
    image_to_png_bytes,
    llava_config,
    make_checkpoint,
    make_llava_checkpoint,
    make_test_image,
)
from tests.checkpoint_files import file_tensors, files_digest

TINY_IMAGE_TOKENS = 9  # (42 // 14) ** 2 patches, CLS dropped


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava") / "tiny")


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_dir).eval()
    return model, AutoProcessor.from_pretrained(tiny_dir)


def test_files_and_config(tiny_dir: Path, loaded) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "chat_template.jinja",
    ):
        assert f in names
    model, processor = loaded
    tok = processor.tokenizer
    cfg = model.config
    assert (
        cfg.image_token_index == tok.convert_tokens_to_ids("<image>") == tok.image_token_id == 400
    )
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        0,
        1,
        2,
        401,
    )
    assert len(tok) == 402 and cfg.text_config.vocab_size == 408  # model vocab > tokenizer
    t = cfg.text_config
    heads = (t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    assert (t.hidden_size, t.num_hidden_layers, *heads) == (80, 3, 4, 2, 20)
    assert cfg.vision_config.image_size == 42 and cfg.vision_feature_layer == -2
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 401)


def test_every_weight_loaded_from_file(tiny_dir: Path, loaded) -> None:
    model, _ = loaded
    on_disk = file_tensors(tiny_dir)
    state = model.state_dict()
    assert len(on_disk) == len(state)
    for name, value in state.items():
        assert torch.equal(on_disk[checkpoint_key(name)], value), name


def test_processor_expands_image_tokens(loaded) -> None:
    model, processor = loaded
    inputs = processor(
        text="USER: <image>\nhi ASSISTANT:", images=[make_test_image(0)], return_tensors="pt"
    )
    ids = inputs["input_ids"][0]
    assert ids[0].item() == processor.tokenizer.bos_token_id
    assert (ids == model.config.image_token_index).sum().item() == TINY_IMAGE_TOKENS
    assert inputs["pixel_values"].shape == (1, 3, 42, 42)


def test_generate_two_images(loaded) -> None:
    model, processor = loaded
    prompt = "USER: <image>\n<image>\nWhat differs? ASSISTANT:"
    images = [make_test_image(1), make_test_image(2)]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        swapped = model.generate(
            **processor(text=prompt, images=images[::-1], return_tensors="pt"),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
        )
    n = inputs["input_ids"].shape[1]
    assert out.shape == (1, n + 8)
    assert not torch.equal(out[0, n:], swapped[0, n:])  # the images matter


def test_seed_determinism(tmp_path: Path) -> None:
    kw = {"text_layers": 1, "vision_layers": 1}
    a = make_llava_checkpoint(tmp_path / "a", seed=3, **kw)
    b = make_llava_checkpoint(tmp_path / "b", seed=3, **kw)
    c = make_llava_checkpoint(tmp_path / "c", seed=4, **kw)
    assert files_digest(a) == files_digest(b) != files_digest(c)
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_sharded_fp16_transformers_layout(tmp_path: Path) -> None:
    from transformers import LlavaForConditionalGeneration

    d = make_llava_checkpoint(
        tmp_path / "s",
        preset="tiny-mha",
        dtype="float16",
        layout="transformers",
        max_shard_bytes=40_000,
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (d / "model.safetensors").exists()
    assert "vision_tower.embeddings.class_embedding" in index["weight_map"]
    model = LlavaForConditionalGeneration.from_pretrained(d)
    assert model.dtype == torch.float16 and model.config.vision_feature_layer == [-2, -1]
    on_disk = file_tensors(d)
    for name, value in model.state_dict().items():
        assert torch.equal(on_disk[checkpoint_key(name, "transformers")], value), name


def test_tiny_mha_full_strategy(tmp_path: Path) -> None:
    from transformers import AutoProcessor

    d = make_llava_checkpoint(tmp_path / "m", preset="tiny-mha", text_layers=1, vision_layers=1)
    processor = AutoProcessor.from_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    assert (
        cfg["text_config"]["num_key_value_heads"] == cfg["text_config"]["num_attention_heads"] == 4
    )
    ids = processor(
        text="USER: <image>\nhi ASSISTANT:", images=[make_test_image(5)], return_tensors="pt"
    )["input_ids"]
    assert (
        ids == cfg["image_token_index"]
    ).sum().item() == TINY_IMAGE_TOKENS + 1  # "full" keeps CLS


def test_tokenizer_round_trip_and_specials(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "café 日本 🙂"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    vocab = tok.get_vocab()
    assert (
        len(tok.tokenize(" 日本")) == 1 and len(tok.tokenize(" 🙂")) == 1
    )  # multi-byte merges exist
    for special in ("<image>", "<s>", "</s>", "<pad>"):
        assert (
            tok(f"a{special}b", add_special_tokens=False).input_ids.count(
                tok.convert_tokens_to_ids(special)
            )
            == 1
        )
    fresh = build_bpe_tokenizer(["<image>"], extra_special_tokens={"image_token": "<image>"})
    assert fresh.get_vocab() == vocab


def test_chat_template(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    uri = image_to_data_uri(make_test_image(0))
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "What is this?"},
            ],
        },
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "And the colour?"},
    ]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "Be brief. USER: <image>\nWhat is this? ASSISTANT: A square.</s>"
        "USER: And the colour? ASSISTANT:"
    )
    single = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert single == "USER: <image>\nWhat is this? ASSISTANT:"
    assert not tok.apply_chat_template(messages[1:2], tokenize=False).endswith("ASSISTANT:")


def test_llava_7b_config_shapes() -> None:
    cfg = llava_config("llava-1.5-7b")
    v, t = cfg.vision_config, cfg.text_config
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (
        1024,
        24,
        16,
        4096,
    )
    assert (v.image_size, v.patch_size, v.hidden_act) == (336, 14, "quick_gelu")
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (
        4096,
        32,
        32,
        32,
    )
    assert (t.intermediate_size, t.vocab_size, t.max_position_embeddings) == (11008, 32064, 4096)
    assert (
        cfg.image_token_index == 32000
        and cfg.image_seq_length == 576
        and cfg.projector_hidden_act == "gelu"
    )
    assert str(cfg.dtype).endswith("float16")


def test_overrides_and_families(tmp_path: Path) -> None:
    cfg = llava_config("tiny", text_hidden=96, text_heads=3, text_kv_heads=1, image_size=28)
    assert cfg.text_config.head_dim == 32 and cfg.image_seq_length == 4
    with pytest.raises(TypeError):
        llava_config("tiny", no_such_size=1)
    with pytest.raises(ValueError, match="llava"):
        make_checkpoint("nope", tmp_path)


def test_images() -> None:
    a, b = make_test_image(0), make_test_image(1)
    assert a.mode == "RGB" and a.size == (48, 40) and make_test_image(2, (64, 32)).size == (64, 32)
    assert image_to_png_bytes(a) == image_to_png_bytes(make_test_image(0))
    assert a.tobytes() != b.tobytes()
    assert image_to_png_bytes(a).startswith(b"\x89PNG")
    assert image_to_data_uri(a).startswith("data:image/png;base64,")
    assert image_to_data_uri(a, "jpeg").startswith("data:image/jpeg;base64,")


def test_default_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMSERVE_HOME", str(tmp_path))
    d = default_model_dir()
    assert d == tmp_path / DEMO_SUBDIR and (d / "model.safetensors").is_file()
    assert default_model_dir() == d
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_SUBDIR]  # no temp dirs left behind
