"""Random Qwen2-VL / Qwen2.5-VL checkpoints: transformers loads every layout we write, and so do we; 7B presets
have the real shapes."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

from mmserve import LLM, SamplingParams
from mmserve.models.loader import build_model, load_hf_config
from mmserve.testing import make_checkpoint
from mmserve.testing.qwen2_vl import (
    SPECIAL_TOKENS,
    _build_tokenizer,
    _param_specs,
    make_qwen2_vl_checkpoint,
    qwen2_vl_config,
    qwen2_vl_sizes,
)
from tests.parity.hf_oracle import hf_greedy

SMALL = dict(text_layers=1, vision_depth=1)  # the loading tests need no depth


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("qwen2_vl_layouts")
    return {
        layout: str(make_qwen2_vl_checkpoint(root / layout, layout=layout, seed=3, **SMALL))
        for layout in ("hub", "transformers")
    }


def test_transformers_loads_both_layouts_to_the_same_weights(layouts):
    states = []
    for model_dir in layouts.values():
        model, info = Qwen2VLForConditionalGeneration.from_pretrained(
            model_dir, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        states.append(model.state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    processor = AutoProcessor.from_pretrained(layouts["hub"])
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert processor.image_processor.size["shortest_edge"] == 28 * 28


def test_our_loader_reads_both_layouts(layouts):
    params = []
    for model_dir in layouts.values():
        model = build_model(
            model_dir, load_hf_config(model_dir), torch.device("cpu"), torch.float32
        )
        params.append(dict(model.named_parameters()))
    assert all(torch.equal(params[0][k], params[1][k]) for k in params[0])
    hf = Qwen2VLForConditionalGeneration.from_pretrained(layouts["hub"]).state_dict()
    # q/k/v are fused in ours: the biases land in the right slices
    q, k, v = (hf[f"model.language_model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv")
    assert torch.equal(
        params[0]["language_model.model.layers.0.self_attn.qkv_proj.bias"], torch.cat([q, k, v])
    )


def test_sharded_tied_checkpoint_loads_and_matches(tmp_path):
    model_dir = str(
        make_checkpoint("qwen2_vl", tmp_path, tie_word_embeddings=True, max_shard_bytes=400_000)
    )
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(model_dir, device="cpu", dtype="float32")
    lm = llm.engine.model.language_model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    prompt = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0), use_tqdm=False
    )[0]
    _, ref, _ = hf_greedy(model_dir, prompt, None, 8)
    assert out.outputs[0].token_ids == ref


def test_chat_template_places_vision_tokens(layouts):
    processor = AutoProcessor.from_pretrained(layouts["hub"])
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>Hi"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_7b_preset_has_the_real_shapes_and_token_ids():
    cfg = qwen2_vl_config("qwen2-vl-7b")
    t, v = cfg.text_config, cfg.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads) == (
        3584,
        28,
        28,
        4,
    )
    assert (t.intermediate_size, t.vocab_size, t.max_position_embeddings) == (18944, 152064, 32768)
    assert (
        t.rope_parameters["mrope_section"] == [16, 24, 24]
        and t.rope_parameters["rope_theta"] == 1e6
    )
    assert (v.depth, v.embed_dim, v.num_heads, v.mlp_ratio, v.hidden_size) == (
        32,
        1280,
        16,
        4,
        3584,
    )
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == (14, 2, 2)
    assert (
        cfg.vision_start_token_id,
        cfg.vision_end_token_id,
        cfg.image_token_id,
        cfg.video_token_id,
    ) == (151652, 151653, 151655, 151656)
    specs = _param_specs(cfg, qwen2_vl_sizes("qwen2-vl-7b"))
    assert (
        sum(math.prod(shape) for _, shape, _, _ in specs) == 8_291_375_616
    )  # Qwen2-VL-7B-Instruct
    tok = _build_tokenizer(qwen2_vl_sizes("qwen2-vl-7b"))
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == list(range(151643, 151657))
    assert tok.eos_token_id == 151645 and tok("hello").input_ids[0] != tok.bos_token_id


def test_bad_presets_and_overrides_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown qwen2_vl preset"):
        qwen2_vl_config("qwen2-vl-72b")
    with pytest.raises(TypeError, match="unknown qwen2_vl overrides"):
        qwen2_vl_config(hidden=8)
    with pytest.raises(ValueError, match="mrope_section"):
        qwen2_vl_config(mrope_section=(2, 2, 2))
    with pytest.raises(ValueError, match="layout"):
        make_qwen2_vl_checkpoint(tmp_path, layout="gguf")


def test_qwen2_5_vl_checkpoint_loads_in_transformers_and_ours(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model_dir = str(make_qwen2_vl_checkpoint(tmp_path, preset="tiny-2.5", **SMALL))
    _, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    model = build_model(model_dir, load_hf_config(model_dir), torch.device("cpu"), torch.float32)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    cfg = qwen2_vl_config("qwen2.5-vl-7b")
    v = cfg.vision_config
    assert (v.hidden_size, v.out_hidden_size, v.intermediate_size, v.window_size) == (
        1280,
        3584,
        3420,
        112,
    )
    assert (
        list(v.fullatt_block_indexes) == [7, 15, 23, 31]
        and cfg.text_config.max_position_embeddings == 128000
    )
    specs = _param_specs(cfg, qwen2_vl_sizes("qwen2.5-vl-7b"))
    assert (
        sum(math.prod(shape) for _, shape, _, _ in specs) == 8_292_166_656
    )  # Qwen2.5-VL-7B-Instruct
