"""Random Kosmos-2 checkpoints: transformers loads both layouts with every tensor from the file, Kosmos2Processor lays
out image prompts as the real model's, HF generates with and without an image, what the text model does with
positions and image embeddings, and the kosmos-2-patch14-224 preset has the real shapes and token ids."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    Kosmos2ForConditionalGeneration,
    Kosmos2Processor,
)

from mmserve.bench.roofline import lm_shape
from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.kosmos2 import (
    _param_specs,
    build_kosmos2_processor,
    checkpoint_key,
    image_placeholder_ids,
    kosmos2_config,
    kosmos2_sizes,
    make_kosmos2_checkpoint,
    token_ids,
)
from tests.checkpoint_files import file_tensors, files_digest, load_matching_the_file
from tests.parity.hf_oracle import text_only_generator

BOS, PAD, EOS, UNK, MASK = 0, 1, 2, 3, 400  # tiny preset ids
BOI, EOI, PHRASE, OBJECT, GROUNDING = 402, 403, 406, 408, 411
PATCH0 = 412  # <patch_index_0000>; <patch_index_0063> = 475
VOCAB = 476
SPAN = [BOI, *range(4, 68), EOI]  # the image span: <image>, 64 placeholders 4..67, </image>
PROMPT = "<grounding> An image of"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kosmos2")
    return {
        layout: make_kosmos2_checkpoint(root / layout, layout=layout)
        for layout in ("hub", "transformers")
    }


@pytest.fixture(scope="module")
def loaded(layouts):
    model = Kosmos2ForConditionalGeneration.from_pretrained(layouts["hub"]).eval()
    return model, AutoProcessor.from_pretrained(layouts["hub"])


def _default_image_tokens(processor: Kosmos2Processor) -> int:
    """How many image placeholders the processor lays out unless told: an attribute in later transformers, the
    images_kwargs default of Kosmos2ProcessorKwargs in 5.17."""
    if hasattr(processor, "num_image_tokens"):
        return processor.num_image_tokens
    return processor.valid_processor_kwargs._defaults["images_kwargs"]["num_image_tokens"]


def _image_embeds(
    model: Kosmos2ForConditionalGeneration, enc: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The projected image features that replace the placeholder rows. transformers 5.17's
    Kosmos2ForConditionalGeneration has no get_image_features; its forward returns the same as image_embeds."""
    if hasattr(model, "get_image_features"):
        return model.get_image_features(enc["pixel_values"]).pooler_output
    return model(**enc).image_embeds


def test_transformers_loads_both_layouts_with_every_tensor_from_the_file(layouts):
    for layout, d in layouts.items():
        model, state, on_disk = load_matching_the_file(
            Kosmos2ForConditionalGeneration,
            d,
            lambda n, layout=layout: checkpoint_key(n, layout),
            absent=("text_model.lm_head.weight",),
        )
        # the tied lm_head is not on disk: 20 tensors per text layer and 3 more (embed_tokens, final norm), 16 per
        # vision layer and 7 more, 11 in the projection (dense 2, latent query, x_attn 8)
        assert "text_model.lm_head.weight" in state and "text_model.lm_head.weight" not in on_disk
        assert len(on_disk) == len(state) - 1 == 3 * 20 + 3 + 2 * 16 + 7 + 11
        assert model.text_model.lm_head.weight is model.text_model.model.embed_tokens.weight
    hub, tf = file_tensors(layouts["hub"]), file_tensors(layouts["transformers"])
    assert hub.keys() == tf.keys() and all(torch.equal(hub[k], tf[k]) for k in hub)
    assert {
        "text_model.model.embed_tokens.weight",
        "text_model.model.layer_norm.bias",
        "text_model.model.layers.2.self_attn.inner_attn_ln.weight",
        "text_model.model.layers.0.ffn.fc1.bias",
        "text_model.model.layers.0.ffn.ffn_layernorm.bias",
        "text_model.model.layers.1.final_layer_norm.weight",
        "vision_model.model.embeddings.class_embedding",
        "vision_model.model.pre_layrnorm.weight",
        "vision_model.model.encoder.layers.1.mlp.fc2.bias",
        "vision_model.model.post_layernorm.bias",
        "image_to_text_projection.latent_query",
        "image_to_text_projection.dense.weight",
        "image_to_text_projection.x_attn.k_proj.bias",
    } <= hub.keys()
    assert hub["text_model.model.embed_tokens.weight"].shape == (VOCAB, 64)
    assert hub["text_model.model.layers.0.ffn.ffn_layernorm.weight"].shape == (144,)
    assert hub["image_to_text_projection.latent_query"].shape == (64, 64)
    assert hub["image_to_text_projection.dense.weight"].shape == (64, 32)
    assert hub["vision_model.model.embeddings.position_embedding.weight"].shape == (
        10,
        32,
    )  # CLS + 3x3


def test_layouts_are_what_save_pretrained_writes(loaded, tmp_path):
    """No conversion mapping: transformers 5 writes the state-dict names either way, without the tied lm_head."""
    model, _ = loaded
    names = {n for n in model.state_dict() if n != "text_model.lm_head.weight"}
    for layout, original in (("hub", True), ("transformers", False)):
        model.save_pretrained(tmp_path / layout, save_original_format=original)
        with safe_open(str(tmp_path / layout / "model.safetensors"), "pt") as st:
            assert set(st.keys()) == {checkpoint_key(n, layout) for n in names}, layout


def test_norms_biases_and_latent_query_are_not_trivial(loaded):
    """LayerNorm scales are ones but the decoder's sub-LayerNorms' (inner_attn_ln, ffn_layernorm); every shift and
    linear bias is random: a missing bias or norm changes the logits."""
    model, _ = loaded
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith((".inner_attn_ln.weight", ".ffn_layernorm.weight")):
            assert 0.01 < (p - 1).abs().mean() < 0.5, name
        elif name.endswith("norm.weight") or name.endswith(
            ("layer_norm1.weight", "layer_norm2.weight")
        ):
            assert bool((p == 1).all()), name
        elif name.endswith(".bias"):
            assert 0.01 < p.abs().mean() < 0.5, name
    assert (
        sum(n.endswith((".inner_attn_ln.weight", ".ffn_layernorm.weight")) for n in params) == 2 * 3
    )
    # text: 6 linears + 4 norms per layer + the final norm; vision: 6 + 2 per layer, pre/post norms; projection 5
    assert sum(n.endswith(".bias") for n in params) == 3 * 10 + 1 + 2 * 8 + 2 + 5
    assert 0.7 < params["image_to_text_projection.latent_query"].std() < 1.3


def test_config_and_special_tokens(layouts, loaded):
    model, processor = loaded
    cfg, tok = model.config, processor.tokenizer
    t, v = cfg.text_config, cfg.vision_config
    assert (
        t.model_type == "kosmos_2_text_model"
        and t.activation_function == "gelu"
        and t.scale_embedding is True
    )
    assert (t.embed_dim, t.layers, t.attention_heads, t.ffn_dim) == (64, 3, 4, 144)
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads) == (
        64,
        3,
        4,
    )  # attribute_map aliases
    assert (t.vocab_size, t.max_position_embeddings, t.layer_norm_eps) == (VOCAB, 1024, 1e-5)
    assert t.tie_word_embeddings is True and cfg.tie_word_embeddings is True
    assert (v.hidden_size, v.num_hidden_layers, v.num_attention_heads, v.intermediate_size) == (
        32,
        2,
        2,
        80,
    )
    assert (v.image_size, v.patch_size, v.hidden_act) == (42, 14, "quick_gelu")
    assert (
        cfg.latent_query_num == 64 == _default_image_tokens(processor)
    )  # the processor's, fixed at 64
    assert not hasattr(
        cfg, "image_token_id"
    )  # image_embeds_position_mask places the image, not a token id
    assert len(tok) == t.vocab_size == VOCAB  # as the real model: the tokenizer fills the vocab
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (
        BOS,
        PAD,
        EOS,
        UNK,
    )
    assert (t.bos_token_id, t.pad_token_id, t.eos_token_id) == (BOS, PAD, EOS)
    gen = json.loads((layouts["hub"] / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS, EOS, PAD)
    tags = [
        "</doc>",
        "<image>",
        "</image>",
        "</chunk>",
        "</line>",
        "<phrase>",
        "</phrase>",
        "<object>",
        "</object>",
        "</delimiter_of_multi_objects/>",
        "<grounding>",
    ]
    assert tok.convert_tokens_to_ids(["<mask>", *tags]) == list(range(MASK, MASK + 12))
    assert tok.convert_tokens_to_ids(
        ["<image>", "</image>", "<phrase>", "<object>", "<grounding>"]
    ) == [BOI, EOI, PHRASE, OBJECT, GROUNDING]
    assert tok.convert_tokens_to_ids(["<patch_index_0000>", "<patch_index_0063>"]) == [
        PATCH0,
        VOCAB - 1,
    ]
    assert token_ids(kosmos2_sizes())["<grounding>"] == GROUNDING
    assert image_placeholder_ids(kosmos2_sizes()) == SPAN[1:-1]
    saved = json.loads((layouts["hub"] / "processor_config.json").read_text())
    assert saved["processor_class"] == "Kosmos2Processor" and saved["num_patch_index_tokens"] == 64
    pre = json.loads((layouts["hub"] / "preprocessor_config.json").read_text())
    assert pre["size"] == {"height": 42, "width": 42} and pre["do_center_crop"] is False


def test_tokenizer_specials_tags_and_chat_template(layouts):
    tok = AutoTokenizer.from_pretrained(layouts["hub"])
    # XLM-R style: special tokens wrap the text (Kosmos2Processor asks for them only with add_eos_token=True)
    ids = tok("a cat").input_ids
    assert ids[0] == BOS and ids[-1] == EOS and tok.decode(ids[1:-1]) == "a cat"
    # the tag and patch tokens are added (not special) tokens: they survive skip_special_tokens, which
    # Kosmos2Processor.post_process_generation relies on
    text = "<grounding><phrase> a cat</phrase><object><patch_index_0009><patch_index_0063></object> sits."
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids[:2] == [GROUNDING, PHRASE] and ids[5:9] == [
        OBJECT,
        PATCH0 + 9,
        PATCH0 + 63,
        OBJECT + 1,
    ]
    assert tok.decode([BOS, *ids, EOS], skip_special_tokens=True) == text
    assert tok.decode(tok("café 日本 🙂").input_ids, skip_special_tokens=True) == "café 日本 🙂"
    # Kosmos-2 has no chat template: this one writes each message's text, one per line, nothing for images
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == PROMPT
    two = [
        *messages,
        {"role": "assistant", "content": "a cat."},
        {"role": "user", "content": "Colour?"},
    ]
    assert tok.apply_chat_template(two, tokenize=False) == f"{PROMPT}\na cat.\nColour?"


def test_processor_lays_out_one_image_and_text(loaded):
    _, processor = loaded
    assert (
        processor.chat_template is None
    )  # Kosmos2Processor.__init__ drops it; the tokenizer has it
    enc = processor(text=PROMPT, images=make_test_image(0), return_tensors="pt")
    assert set(enc) == {"pixel_values", "input_ids", "attention_mask", "image_embeds_position_mask"}
    assert (
        enc["pixel_values"].shape == (1, 3, 42, 42) and enc["pixel_values"].dtype == torch.float32
    )
    ids = enc["input_ids"][0].tolist()
    # "</image> <grounding> An image of": the space before <grounding> is stripped (lstrip), the one after stays
    text = processor.tokenizer(" " + PROMPT, add_special_tokens=False).input_ids
    assert text[0] == GROUNDING
    assert ids == [BOS, *SPAN, *text] and len(ids) == 1 + 66 + len(text)
    assert enc["image_embeds_position_mask"][0].tolist() == [0, 0] + [1] * 64 + [0] * (
        1 + len(text)
    )
    assert enc["attention_mask"].tolist() == [[1] * len(ids)]
    assert enc["image_embeds_position_mask"].dtype == torch.int64

    # with add_eos_token: the tokenizer's <s> ... </s>, the same image span
    eos = processor(text=PROMPT, images=make_test_image(0), add_eos_token=True)
    assert eos["input_ids"] == [*ids, EOS] and eos["image_embeds_position_mask"][:67] == [0, 0] + [
        1
    ] * 64 + [0]
    # a float box becomes two patch index tokens after its phrase, on a sqrt(64) = 8 per side grid
    boxed = processor(
        text="<grounding><phrase> a cat</phrase> sits.",
        images=make_test_image(0),
        bboxes=[(0.1, 0.2, 0.5, 0.9)],
    )["input_ids"]
    assert boxed[72:76] == [OBJECT, PATCH0 + 1 * 8 + 0, PATCH0 + 7 * 8 + 3, OBJECT + 1]
    # text only: <s> + text, nothing else
    only = processor(text=PROMPT, return_tensors="pt")
    assert set(only) == {"input_ids", "attention_mask"}
    assert only["input_ids"][0].tolist() == [
        BOS,
        *processor.tokenizer(PROMPT, add_special_tokens=False).input_ids,
    ]
    # a batch pads on the right with <pad> (id 1, which the sinusoidal positions treat as padding)
    batch = processor(
        text=["A cat", "A dog sits there"],
        images=[make_test_image(0), make_test_image(1)],
        padding=True,
        return_tensors="pt",
    )
    assert batch["pixel_values"].shape == (2, 3, 42, 42)
    assert (
        batch["input_ids"].shape
        == batch["image_embeds_position_mask"].shape
        == batch["attention_mask"].shape
    )
    assert batch["input_ids"][0, -1] == PAD and batch["attention_mask"][0, -1] == 0
    assert batch["image_embeds_position_mask"].sum(1).tolist() == [64, 64]


def test_text_embedding_scale_positions_and_image_placement(loaded):
    """What a model implementer must match: image embeddings replace the placeholder rows *before* the sqrt(embed_dim)
    scale, and the sinusoidal positions (sin half, cos half; no weights) start at pad_token_id + 1 = 2, pads
    (id 1) getting the zero row."""
    model, processor = loaded
    lm = model.text_model.model
    enc = processor(text=PROMPT, images=make_test_image(0), return_tensors="pt")
    ids, mask = enc["input_ids"], enc["image_embeds_position_mask"]
    with torch.no_grad():
        image_embeds = _image_embeds(model, enc)
        got = lm.forward_embedding(input_ids=ids, image_embeds=image_embeds, img_input_mask=mask)
    assert image_embeds.shape == (1, 64, 64)
    n, d = ids.shape[1], 64
    freqs = torch.exp(torch.arange(d // 2) * -(math.log(10000) / (d // 2 - 1)))
    angles = torch.arange(2, n + 2)[:, None].float() * freqs[None]
    positions = torch.cat([angles.sin(), angles.cos()], dim=1)
    tokens = lm.embed_tokens.weight[ids[0]].clone()
    tokens[mask[0].bool()] = image_embeds[0]
    assert (
        lm.embed_scale == 8.0
        and lm.embed_positions.padding_idx == PAD
        and lm.embed_positions.offset == 2
    )
    assert torch.allclose(got[0], tokens * 8.0 + positions, atol=1e-5)
    padded = lm.embed_positions.create_position_ids_from_input_ids(
        torch.tensor([[BOS, 5, PAD, 6]]), PAD
    )
    assert padded.tolist() == [[2, 3, 1, 4]] and bool((lm.embed_positions.weights[PAD] == 0).all())


def test_the_image_matters(loaded):
    model, processor = loaded
    logits = []
    for seed in (0, 3):
        with torch.no_grad():
            enc = processor(text=PROMPT, images=make_test_image(seed), return_tensors="pt")
            logits.append(model(**enc).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 0.5
    assert logits[0].std() > 0.5  # spread out: greedy decoding is not a near-tie


def test_greedy_generate_with_and_without_an_image(loaded):
    """Without an image the text model alone generates (the parity oracle's way): Kosmos2ForConditionalGeneration's
    forward needs pixel_values or image_embeds; its generate runs the text model alone itself (not in transformers
    5.17, where it runs the vision tower on pixel_values=None)."""
    model, processor = loaded
    inputs = [
        processor(text=PROMPT, images=make_test_image(0), return_tensors="pt"),
        processor(text="Describe a red square.", return_tensors="pt"),
    ]
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    for generator, enc in ((model, inputs[0]), (text_only_generator(model), inputs[1])):
        with torch.no_grad():
            out = generator.generate(**enc, **greedy)
        n = enc["input_ids"].shape[1]
        assert out.shape == (1, n + 8) and bool((out[0, n:] < VOCAB).all())
        assert torch.equal(out[0, :n], enc["input_ids"][0])
    with pytest.raises(ValueError, match="pixel_values"):
        model(**inputs[1])
    with torch.no_grad():
        try:
            full = model.generate(**inputs[1], **greedy)
        except ValueError as e:  # raised by the vision tower, run on pixel_values=None
            if "You have to specify pixel_values" not in str(e):
                raise
            pytest.skip(
                "transformers 5.17's Kosmos2ForConditionalGeneration.generate wants pixel_values"
            )
    assert torch.equal(full, out)  # the text model's ids above


def test_seed_determinism_and_sharding(tmp_path):
    kw = {"text_layers": 2}
    a = make_kosmos2_checkpoint(tmp_path / "a", seed=3, **kw)
    b = make_kosmos2_checkpoint(tmp_path / "b", seed=3, **kw)
    c = make_kosmos2_checkpoint(tmp_path / "c", seed=4, **kw)
    assert files_digest(a) == files_digest(b) != files_digest(c)
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    d = make_checkpoint(
        "kosmos2", tmp_path / "d", seed=3, max_shard_bytes=100_000, layout="transformers", **kw
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((d / "config.json").read_text())["architectures"] == [
        "Kosmos2ForConditionalGeneration"
    ]
    sharded, single = file_tensors(d), file_tensors(a)
    assert sharded.keys() == single.keys() and all(
        torch.equal(sharded[k], single[k]) for k in sharded
    )


def test_roofline_counts_the_text_model(tmp_path):
    """lm_shape reads Kosmos-2's own config keys and counts every text-model tensor but the embedding table (the
    tied lm_head once more): biases, LayerNorms, the two sub-LayerNorms per layer."""
    for preset in ("tiny", "kosmos-2-patch14-224"):
        config = kosmos2_config(preset)
        config.save_pretrained(tmp_path / preset)
        with torch.device("meta"):
            model = Kosmos2ForConditionalGeneration(config)
        elements = sum(
            p.numel()
            for n, p in model.named_parameters(remove_duplicate=False)
            if n.startswith("text_model.") and "embed_tokens" not in n
        )
        for dtype, nbytes in (("float32", 4), ("float16", 2)):
            shape = lm_shape(str(tmp_path / preset), dtype)
            assert shape.weight_bytes == elements * nbytes, (preset, dtype)
        assert shape.kv_heads == shape.heads == config.text_config.attention_heads
        assert (
            shape.kv_bytes_per_token
            == 2 * config.text_config.layers * config.text_config.embed_dim * 2
        )


def test_real_preset_has_the_real_shapes():
    cfg = kosmos2_config("kosmos-2-patch14-224")
    t, v = cfg.text_config, cfg.vision_config
    assert (t.embed_dim, t.layers, t.attention_heads, t.ffn_dim) == (2048, 24, 32, 8192)
    assert (t.vocab_size, t.max_position_embeddings, t.layer_norm_eps, t.activation_function) == (
        65037,
        2048,
        1e-5,
        "gelu",
    )
    assert t.scale_embedding is True and t.tie_word_embeddings is True
    assert (t.bos_token_id, t.pad_token_id, t.eos_token_id) == (0, 1, 2)
    assert (v.hidden_size, v.intermediate_size, v.num_hidden_layers, v.num_attention_heads) == (
        1024,
        4096,
        24,
        16,
    )
    assert (v.image_size, v.patch_size, v.hidden_act, cfg.latent_query_num) == (
        224,
        14,
        "quick_gelu",
        64,
    )
    assert str(t.dtype).endswith("float16") and str(v.dtype).endswith("float16")
    # every size but the dtype is Kosmos2Config's default (= microsoft/kosmos-2-patch14-224)
    from transformers import Kosmos2Config

    default = Kosmos2Config()
    ignore = {
        "dtype",
        "architectures",
        "init_std",
        "initializer_range",
        "_name_or_path",
        "transformers_version",
    }
    for ours, ref in ((t, default.text_config), (v, default.vision_config)):
        a, b = ours.to_dict(), ref.to_dict()
        assert {k: a[k] for k in a if k not in ignore} == {k: b[k] for k in b if k not in ignore}
    specs = {
        name: shape for name, shape, _ in _param_specs(cfg, kosmos2_sizes("kosmos-2-patch14-224"))
    }
    assert (
        specs["text_model.model.embed_tokens.weight"] == (65037, 2048)
        and "text_model.lm_head.weight" not in specs
    )
    assert specs["vision_model.model.embeddings.position_embedding.weight"] == (257, 1024)
    assert specs["image_to_text_projection.latent_query"] == (64, 2048)
    assert (
        sum(math.prod(s) for s in specs.values()) == 1_664_485_376
    )  # 1.66B, the tied lm_head once


def test_real_preset_tokenizer_has_the_real_ids():
    """The ids transformers' Kosmos2Processor tests expect of microsoft/kosmos-2-patch14-224's tokenizer."""
    processor, _ = build_kosmos2_processor(kosmos2_sizes("kosmos-2-patch14-224"))
    tok = processor.tokenizer
    assert len(tok) == 65037
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    names = [
        "<image>",
        "</image>",
        "<phrase>",
        "</phrase>",
        "<object>",
        "</object>",
        "</delimiter_of_multi_objects/>",
        "<grounding>",
        "<patch_index_0079>",
        "<patch_index_1023>",
    ]
    assert tok.convert_tokens_to_ids(names) == [
        64003,
        64004,
        64007,
        64008,
        64009,
        64010,
        64011,
        64012,
        64092,
        65036,
    ]


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown kosmos2 preset"):
        kosmos2_config("kosmos-2.5")
    with pytest.raises(TypeError, match="unknown kosmos2 overrides"):
        kosmos2_config(num_layers=2)
    with pytest.raises(ValueError, match="must divide"):
        kosmos2_config(text_heads=3)
    with pytest.raises(ValueError, match="square"):
        kosmos2_config(num_patch_index_tokens=60)
    with pytest.raises(ValueError, match="layout"):
        make_kosmos2_checkpoint(tmp_path, layout="microsoft")
