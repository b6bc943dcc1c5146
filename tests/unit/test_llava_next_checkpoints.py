"""Tiny LLaVA-NeXT / LLaVA-OneVision checkpoints load in transformers (and in mmserve) with every weight from
the files; the 7B presets have the published shapes; anyres placeholder counts equal HF's processor's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mmserve.models.anyres import AnyresSpec, num_video_tokens
from mmserve.models.loader import build_model, load_hf_config
from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.llava_next import (
    llava_next_config,
    make_llava_next_checkpoint,
    next_checkpoint_key,
)
from mmserve.testing.llava_onevision import llava_onevision_config, make_llava_onevision_checkpoint
from tests.checkpoint_files import file_tensors


def _hf_loads_every_weight(d: Path, layout: str = "hub"):
    import transformers

    cfg = json.loads((d / "config.json").read_text())
    model = getattr(transformers, cfg["architectures"][0]).from_pretrained(d).eval()
    on_disk = file_tensors(d)
    state = model.state_dict()
    tied = model.config.tie_word_embeddings
    assert len(on_disk) == len(state) - tied
    for name, value in state.items():
        key = next_checkpoint_key(
            "model.language_model.embed_tokens.weight"
            if tied and name == "lm_head.weight"
            else name,
            layout,
        )
        assert torch.equal(on_disk[key], value), name
    return model


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision"])
def test_tiny_checkpoints_load_in_transformers_and_generate(tmp_path, family):
    from transformers import AutoProcessor

    d = make_checkpoint(family, tmp_path / family, text_layers=1, vision_layers=1)
    names = {p.name for p in d.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "processor_config.json",
        "preprocessor_config.json",
        "chat_template.jinja",
        "generation_config.json",
    } <= names
    model = _hf_loads_every_weight(d)
    processor = AutoProcessor.from_pretrained(d)
    message = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    ]
    prompt = processor.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
    enc = processor(text=prompt, images=[make_test_image(0, (48, 40))], return_tensors="pt")
    spec = AnyresSpec.from_config(model.config)
    assert enc["pixel_values"].shape == (1, 3, 3, 42, 42)  # base tile + a 1x2 mosaic of 42 px tiles
    assert (
        (enc["input_ids"] == model.config.image_token_index).sum().item()
        == spec.num_tokens((40, 48))
        == 90
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == enc["input_ids"].shape[1] + 4


def test_chat_templates_render_the_family_prompt_formats(tmp_path):
    from transformers import AutoProcessor

    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    nxt = AutoProcessor.from_pretrained(
        make_llava_next_checkpoint(tmp_path / "n", text_layers=1, vision_layers=1)
    )
    assert (
        nxt.apply_chat_template(message, add_generation_prompt=True, tokenize=False)
        == "[INST] <image>\nHi? [/INST]"
    )
    ov = AutoProcessor.from_pretrained(
        make_llava_onevision_checkpoint(tmp_path / "o", text_layers=1, vision_layers=1)
    )
    video = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi?"}]}]
    assert (
        ov.apply_chat_template(video, add_generation_prompt=True, tokenize=False)
        == "<|im_start|>user <video>\nHi?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_transformers_layout_sharded_fp16_tied_loads_in_both(tmp_path):
    d = make_llava_onevision_checkpoint(
        tmp_path / "t",
        preset="tiny-tied",
        dtype="float16",
        layout="transformers",
        max_shard_bytes=40_000,
        text_layers=1,
        vision_layers=2,
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and "image_newline" in index["weight_map"]
    assert "vision_tower.embeddings.patch_embedding.bias" in index["weight_map"]
    assert not any(
        k.endswith("lm_head.weight") for k in index["weight_map"]
    )  # tied to the embeddings
    model = _hf_loads_every_weight(d, layout="transformers")
    assert model.dtype == torch.float16 and model.config.vision_feature_layer == [-2, -1]
    ours = build_model(str(d), load_hf_config(str(d)), torch.device("cpu"), torch.float32)
    assert torch.equal(ours.image_newline, model.model.image_newline.float())
    assert ours.language_model.lm_head.weight is ours.language_model.model.embed_tokens.weight


def test_7b_preset_configs_have_the_published_shapes():
    from transformers import (
        LlavaNextForConditionalGeneration,
        LlavaOnevisionForConditionalGeneration,
    )

    nxt = llava_next_config("llava-v1.6-mistral-7b")
    t, v = nxt.text_config, nxt.vision_config
    assert (
        t.model_type,
        t.hidden_size,
        t.num_hidden_layers,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
        t.vocab_size,
        t.sliding_window,
    ) == ("mistral", 4096, 32, 32, 8, 14336, 32064, None)
    assert (v.model_type, v.hidden_size, v.num_hidden_layers, v.image_size, v.patch_size) == (
        "clip_vision_model",
        1024,
        24,
        336,
        14,
    )
    assert nxt.image_grid_pinpoints == [
        [336, 672],
        [672, 336],
        [672, 672],
        [1008, 336],
        [336, 1008],
    ]
    assert (
        nxt.image_token_index,
        nxt.vision_feature_layer,
        nxt.vision_feature_select_strategy,
    ) == (32000, -2, "default")
    ov = llava_onevision_config("llava-onevision-qwen2-7b-ov")
    t, v = ov.text_config, ov.vision_config
    assert (
        t.model_type,
        t.hidden_size,
        t.num_hidden_layers,
        t.num_attention_heads,
        t.num_key_value_heads,
        t.intermediate_size,
        t.vocab_size,
    ) == ("qwen2", 3584, 28, 28, 4, 18944, 152128)
    assert (
        v.model_type,
        v.hidden_size,
        v.num_hidden_layers,
        v.image_size,
        v.patch_size,
        v.vision_use_head,
    ) == ("siglip_vision_model", 1152, 26, 384, 14, False)
    assert len(ov.image_grid_pinpoints) == 36 and ov.image_grid_pinpoints[-1] == [2304, 2304]
    assert (ov.image_token_index, ov.video_token_index, ov.vision_aspect_ratio) == (
        151646,
        151647,
        "anyres_max_9",
    )
    for cls, cfg, params in (
        (LlavaNextForConditionalGeneration, nxt, 7_566_747_648),
        (LlavaOnevisionForConditionalGeneration, ov, 8_030_807_584),
    ):
        with torch.device("meta"):
            assert sum(p.numel() for p in cls(cfg).parameters()) == params


def test_anyres_counts_equal_hf_processors_at_7b_sizes(tmp_path):
    """Our placeholder counts (336/384 px tiles, grids of 24 and 27, anyres_max_9) match HF's processors."""
    from transformers import (
        AutoTokenizer,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    nxt_cfg, ov_cfg = (
        llava_next_config("llava-v1.6-mistral-7b"),
        llava_onevision_config("llava-onevision-qwen2-7b-ov"),
    )
    tok = AutoTokenizer.from_pretrained(
        make_llava_onevision_checkpoint(tmp_path / "o", text_layers=1, vision_layers=1)
    )
    nxt = LlavaNextProcessor(
        LlavaNextImageProcessor(image_grid_pinpoints=nxt_cfg.image_grid_pinpoints),
        tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    ov = LlavaOnevisionProcessor(
        LlavaOnevisionImageProcessor(image_grid_pinpoints=ov_cfg.image_grid_pinpoints),
        tok,
        LlavaOnevisionVideoProcessor(),
        num_image_tokens=729,
        vision_feature_select_strategy="full",
    )
    nxt_spec, ov_spec = AnyresSpec.from_config(nxt_cfg), AnyresSpec.from_config(ov_cfg)
    rng = random.Random(0)
    sizes = [(rng.randint(4, 3000), rng.randint(4, 3000)) for _ in range(300)] + [
        (336, 336),
        (384, 384),
        (20, 2900),
    ]
    for h, w in sizes:
        if min(nxt_spec.feature_grid((h, w))) > 0:
            assert nxt_spec.num_tokens((h, w)) == nxt._get_number_of_features(h, w, 336, 336) - 1, (
                h,
                w,
            )
        if min(ov_spec.feature_grid((h, w))) > 0:
            assert ov_spec.num_tokens((h, w)) == ov._get_number_of_features(h, w, 384, 384), (h, w)
    # the placeholders the processor writes for an 8-frame video; the count from sizes alone where it has one
    # (transformers 5.17's _get_num_multimodal_tokens counts images only)
    frames = np.zeros((8, 384, 384, 3), dtype=np.uint8)
    written = ov(text=ov.video_token, videos=[frames], return_tensors="pt")["input_ids"]
    assert (
        [int((written == ov.video_token_id).sum())]
        == [num_video_tokens(8, 27)]
        == [8 * 14 * 14 + 1]
    )
    hf_video = ov._get_num_multimodal_tokens(video_sizes=[(8, 384, 384)])["num_video_tokens"]
    assert hf_video in (None, [num_video_tokens(8, 27)])
