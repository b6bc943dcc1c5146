"""Random Nougat checkpoints: transformers loads both layouts with every tensor from the file, NougatProcessor turns a
page into pixel_values of the configured size, what the MBart decoder computes (checked against a plain re-computation),
HF greedy generation from <s>, determinism, the roofline's decoder count, and the nougat-base preset's real shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoProcessor, AutoTokenizer, VisionEncoderDecoderModel

from mmserve.bench.roofline import lm_shape
from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.nougat import (
    _param_specs,
    build_nougat_processor,
    checkpoint_key,
    make_nougat_checkpoint,
    nougat_config,
    nougat_sizes,
    relative_position_index,
    token_ids,
)
from tests.checkpoint_files import file_tensors, files_digest, load_matching_the_file

BOS, PAD, EOS, UNK = 0, 1, 2, 3  # every preset
VOCAB, D, LAYERS, HEADS, FFN = 400, 64, 3, 4, 144  # tiny decoder
HEIGHT, WIDTH, IMAGE_TOKENS = 72, 48, 9 * 6  # tiny page: 18x12 patches, merged once to 9x6
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
LM_HEAD, EMBED = "decoder.lm_head.weight", "decoder.model.decoder.embed_tokens.weight"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nougat")
    return {
        layout: make_nougat_checkpoint(root / layout, layout=layout)
        for layout in ("hub", "transformers")
    }


@pytest.fixture(scope="module")
def loaded(layouts):
    model = VisionEncoderDecoderModel.from_pretrained(layouts["hub"]).eval()
    return model, AutoProcessor.from_pretrained(layouts["hub"])


def _auto_tokenizer_class() -> str:
    """The class AutoTokenizer gives a Nougat checkpoint: its tokenizer_class, NougatTokenizer, but transformers 5.17
    maps every vision-encoder-decoder checkpoint (facebook/nougat-base too) to a plain TokenizersBackend."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    return TOKENIZER_MAPPING_NAMES.get("vision-encoder-decoder") or "NougatTokenizer"


def _pixels(processor, seed: int = 0) -> torch.Tensor:
    return processor(images=make_test_image(seed), return_tensors="pt")["pixel_values"]


def test_transformers_loads_both_layouts_with_every_tensor_from_the_file(layouts):
    for layout, d in layouts.items():
        model, state, on_disk = load_matching_the_file(
            VisionEncoderDecoderModel, d, lambda n, layout=layout: checkpoint_key(n, layout)
        )
        # encoder: 4 embedding tensors, 18 per Swin block (with its relative_position_index), 3 in the patch merging;
        # decoder: 26 per layer, embed_tokens, embed_positions, layernorm_embedding and layer_norm (2 each), lm_head
        assert len(on_disk) == len(state) == (4 + 4 * 18 + 3) + (3 * 26 + 6 + 1)
        assert not hasattr(
            model, "enc_to_dec_proj"
        )  # the Swin output width is d_model: no projection
        assert (
            model.decoder.lm_head.weight is not model.decoder.model.decoder.embed_tokens.weight
        )  # not tied
    hub, tf = file_tensors(layouts["hub"]), file_tensors(layouts["transformers"])
    assert hub.keys() == tf.keys() and all(torch.equal(hub[k], tf[k]) for k in hub)
    assert {
        "encoder.embeddings.patch_embeddings.projection.weight",
        "encoder.embeddings.norm.bias",
        "encoder.encoder.layers.0.blocks.1.attention.self.relative_position_bias_table",
        "encoder.encoder.layers.1.blocks.0.attention.self.query.bias",
        "encoder.encoder.layers.1.blocks.1.attention.output.dense.weight",
        "encoder.encoder.layers.0.blocks.0.intermediate.dense.bias",
        "encoder.encoder.layers.0.downsample.norm.bias",
        "decoder.model.decoder.embed_positions.weight",
        "decoder.model.decoder.layernorm_embedding.bias",
        "decoder.model.decoder.layers.2.encoder_attn.k_proj.bias",
        "decoder.model.decoder.layers.0.encoder_attn_layer_norm.weight",
        "decoder.model.decoder.layers.1.self_attn.out_proj.bias",
        "decoder.model.decoder.layers.0.fc2.bias",
        "decoder.model.decoder.layer_norm.weight",
        LM_HEAD,
    } <= hub.keys()
    assert not any("final_logits_bias" in k or "layernorm." in k or "pooler" in k for k in hub)
    assert hub[EMBED].shape == hub[LM_HEAD].shape == (VOCAB, D) and not torch.equal(
        hub[EMBED], hub[LM_HEAD]
    )
    assert hub["decoder.model.decoder.embed_positions.weight"].shape == (256 + 2, D)  # offset 2
    assert hub["decoder.model.decoder.layers.0.fc1.weight"].shape == (FFN, D)
    assert hub["encoder.embeddings.patch_embeddings.projection.weight"].shape == (32, 3, 4, 4)
    assert hub["encoder.encoder.layers.0.downsample.reduction.weight"].shape == (
        64,
        4 * 32,
    )  # no bias
    assert hub[
        "encoder.encoder.layers.1.blocks.0.attention.self.relative_position_bias_table"
    ].shape == (5 * 5, 4)
    # the index buffers are int64, as transformers computes them; everything else is in the model dtype
    index = hub["encoder.encoder.layers.1.blocks.1.attention.self.relative_position_index"]
    assert index.dtype == torch.int64 and torch.equal(index, relative_position_index(3))
    block = (
        VisionEncoderDecoderModel.from_pretrained(layouts["hub"])
        .encoder.encoder.layers[0]
        .blocks[0]
    )
    assert torch.equal(block.attention.self.create_relative_position_index(), index)
    assert {t.dtype for k, t in hub.items() if not k.endswith("relative_position_index")} == {
        torch.float32
    }


def test_layouts_are_what_save_pretrained_writes(loaded, tmp_path):
    """No conversion mapping: transformers 5 writes the state-dict names either way, index buffers included."""
    model, _ = loaded
    for layout, original in (("hub", True), ("transformers", False)):
        model.save_pretrained(tmp_path / layout, save_original_format=original)
        with safe_open(str(tmp_path / layout / "model.safetensors"), "pt") as st:
            assert set(st.keys()) == {checkpoint_key(n, layout) for n in model.state_dict()}, layout


def test_norms_biases_and_position_tables_are_not_trivial(loaded):
    """LayerNorm scales are ones; every shift, linear/conv bias and relative position bias table is random: a
    missing bias, norm or table changes the logits."""
    model, _ = loaded
    params = dict(model.named_parameters())
    norms = {n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
    for name, p in params.items():
        if name.rsplit(".", 1)[0] in norms and name.endswith(".weight"):
            assert bool((p == 1).all()), name
        elif name.endswith(".bias"):
            assert 0.05 < p.abs().mean() < 0.2, name
        elif name.endswith(".relative_position_bias_table"):
            assert 0.3 < p.std() < 0.7, name
    # encoder: 8 per block, the patch embedding's conv and norm, the merging's norm; decoder: 13 per layer + 2 norms
    assert sum(n.endswith(".bias") for n in params) == (4 * 8 + 2 + 1) + (3 * 13 + 2)
    assert len(norms) == (1 + 4 * 2 + 1) + (3 * 3 + 2)


def test_config_tokens_and_saved_files(layouts, loaded):
    model, processor = loaded
    cfg, tok = model.config, processor.tokenizer
    enc, dec = cfg.encoder, cfg.decoder
    assert (cfg.model_type, enc.model_type, dec.model_type) == (
        "vision-encoder-decoder",
        "donut-swin",
        "mbart",
    )
    assert cfg.architectures == ["VisionEncoderDecoderModel"]
    assert (
        cfg.decoder_start_token_id,
        cfg.pad_token_id,
        cfg.eos_token_id,
        cfg.tie_word_embeddings,
    ) == (BOS, PAD, EOS, False)
    assert (enc.image_size, enc.patch_size, enc.window_size, enc.embed_dim) == (
        [HEIGHT, WIDTH],
        4,
        3,
        32,
    )
    assert (enc.depths, enc.num_heads, enc.hidden_size, enc.mlp_ratio, enc.hidden_act) == (
        [2, 2],
        [2, 4],
        D,
        4.0,
        "gelu",
    )
    assert (enc.use_absolute_embeddings, enc.qkv_bias, enc.layer_norm_eps) == (False, True, 1e-5)
    assert (dec.d_model, dec.decoder_layers, dec.decoder_attention_heads, dec.decoder_ffn_dim) == (
        D,
        LAYERS,
        HEADS,
        FFN,
    )
    assert (dec.vocab_size, dec.max_position_embeddings, dec.activation_function) == (
        VOCAB,
        256,
        "gelu",
    )
    assert dec.is_decoder and dec.add_cross_attention and not dec.is_encoder_decoder
    assert (
        dec.scale_embedding is True
        and dec.tie_word_embeddings is False
        and dec.add_final_layer_norm is True
    )
    assert (dec.bos_token_id, dec.pad_token_id, dec.eos_token_id, dec.forced_eos_token_id) == (
        BOS,
        PAD,
        EOS,
        EOS,
    )
    assert dec.decoder_start_token_id == BOS
    # a trap the real config has too: MBart's aliases name the (absent) encoder's sizes, not the decoder's
    assert (dec.num_hidden_layers, dec.hidden_size, dec.num_attention_heads) == (12, D, HEADS)
    assert str(dec.dtype).endswith("float32") and str(enc.dtype).endswith("float32")
    gen = json.loads((layouts["hub"] / "generation_config.json").read_text())
    assert {
        k: gen[k]
        for k in (
            "bos_token_id",
            "decoder_start_token_id",
            "eos_token_id",
            "forced_eos_token_id",
            "pad_token_id",
        )
    } == {
        "bos_token_id": BOS,
        "decoder_start_token_id": BOS,
        "eos_token_id": EOS,
        "forced_eos_token_id": EOS,
        "pad_token_id": PAD,
    }
    assert (
        type(tok).__name__ == _auto_tokenizer_class()
        and type(processor).__name__ == "NougatProcessor"
    )
    assert len(tok) == VOCAB and token_ids() == {
        "<s>": BOS,
        "<pad>": PAD,
        "</s>": EOS,
        "<unk>": UNK,
    }
    assert (tok.bos_token, tok.pad_token, tok.eos_token, tok.unk_token) == (
        "<s>",
        "<pad>",
        "</s>",
        "<unk>",
    )
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (
        BOS,
        PAD,
        EOS,
        UNK,
    )
    saved = json.loads((layouts["hub"] / "processor_config.json").read_text())
    assert saved["processor_class"] == "NougatProcessor"
    pre = json.loads((layouts["hub"] / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "NougatImageProcessor" and pre["size"] == {
        "height": HEIGHT,
        "width": WIDTH,
    }
    assert (
        pre["do_crop_margin"],
        pre["do_thumbnail"],
        pre["do_pad"],
        pre["do_align_long_axis"],
    ) == (True, True, True, False)
    assert pre["image_mean"] == [0.485, 0.456, 0.406] and pre["image_std"] == [0.229, 0.224, 0.225]
    assert pre["resample"] == 2
    assert (
        json.loads((layouts["hub"] / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "NougatTokenizer"
    )


def test_tokenizer_pipeline_and_post_processing(layouts):
    tok = AutoTokenizer.from_pretrained(layouts["hub"])
    ids = tok("a cat").input_ids
    assert ids[0] == BOS and ids[-1] == EOS and tok.decode(ids[1:-1]) == "a cat"
    assert tok.decode(ids, skip_special_tokens=True) == "a cat"
    # Nougat's pre-tokenizer: digits one by one, punctuation isolated, newlines apart; no padding unless asked
    pieces = tok.convert_ids_to_tokens(tok("x = 12 (a)\n", add_special_tokens=False).input_ids)
    assert pieces == ["x", "Ġ", "=", "Ġ", "1", "2", "Ġ", "(", "a", ")", "Ċ"]
    assert (
        tok.decode(tok("café 日本 🙂\n\n# Title").input_ids, skip_special_tokens=True)
        == "café 日本 🙂\n\n# Title"
    )
    batch = tok(["a", "a cat sat"], padding=True).input_ids
    assert len(batch[0]) == len(batch[1]) and batch[0][-1] == PAD
    # NougatProcessor: with text and images the text becomes labels (<s> text </s>) and there is no attention mask
    processor = AutoProcessor.from_pretrained(layouts["hub"])
    both = processor(images=make_test_image(0), text="a cat", return_tensors="pt")
    assert (
        set(both) == {"pixel_values", "labels"}
        and both["labels"][0].tolist() == tok("a cat").input_ids
    )
    if not hasattr(type(processor.tokenizer), "post_process_generation"):
        pytest.skip(
            f"transformers 5.17 loads the checkpoint's tokenizer as {type(processor.tokenizer).__name__}, "
            "which has no post_process_generation (NougatTokenizer's markdown clean-up)"
        )
    try:  # Nougat's markdown clean-up needs the optional nltk and python-Levenshtein packages
        import Levenshtein  # noqa: F401
        import nltk  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="NLTK|Levenshtein"):
            processor.post_process_generation("# Title\n\nText.")
    else:
        assert isinstance(processor.post_process_generation("# Title\n\nText."), str)


def test_processor_crops_resizes_and_pads_a_page_to_image_size(loaded):
    """The 48x40 test image: margin crop (nothing to crop), shorter side resized to min(72, 48) = 48 (-> 57x48),
    thumbnail to fit 48 wide (-> 48x40), then padded with black to 72x48: 16 rows above and below."""
    _, processor = loaded
    pv = _pixels(processor)
    assert pv.shape == (1, 3, HEIGHT, WIDTH) and pv.dtype == torch.float32
    black = (-MEAN / STD)[:, None, None]
    assert torch.allclose(pv[0, :, :16], black.expand(3, 16, WIDTH)) and torch.allclose(
        pv[0, :, 56:], black.expand(3, 16, WIDTH)
    )
    assert not torch.allclose(pv[0, :, 16], black[:, :, 0].expand(3, WIDTH))
    assert not torch.allclose(pv[0, :, 55], black[:, :, 0].expand(3, WIDTH))
    # a white margin around the page is cropped away first
    page = Image.new("RGB", (96, 80), (255, 255, 255))
    page.paste(make_test_image(0), (20, 10))
    assert torch.equal(processor(images=page, return_tensors="pt")["pixel_values"], pv)
    # any size comes out as image_height x image_width; a batch stacks
    for size in ((300, 200), (20, 90), (48, 72)):
        assert processor(images=make_test_image(1, size), return_tensors="pt")[
            "pixel_values"
        ].shape == (1, 3, HEIGHT, WIDTH)
    two = processor(images=[make_test_image(0), make_test_image(2, (30, 60))], return_tensors="pt")[
        "pixel_values"
    ]
    assert two.shape == (2, 3, HEIGHT, WIDTH) and torch.equal(two[:1], pv)


def _layer_norm(x: torch.Tensor, ln: torch.nn.LayerNorm) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, 1e-5)


def _attend(x: torch.Tensor, memory: torch.Tensor, attn, causal: bool) -> torch.Tensor:
    """q from x, k and v from memory, HEADS heads, softmax(q k^T / sqrt(head_dim)), out_proj; all with biases."""

    def heads(t):
        return t.view(t.shape[0], HEADS, D // HEADS).transpose(0, 1)

    q, k, v = heads(attn.q_proj(x)), heads(attn.k_proj(memory)), heads(attn.v_proj(memory))
    scores = q @ k.transpose(1, 2) / math.sqrt(D // HEADS)
    if causal:
        scores = scores.masked_fill(
            torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf")
        )
    return attn.out_proj((scores.softmax(-1) @ v).transpose(0, 1).reshape(x.shape[0], D))


def test_decoder_is_a_pre_layernorm_mbart_with_cross_attention_in_every_layer(loaded):
    """What a model implementer must match, re-computed by hand against the HF logits: token embeddings times
    sqrt(d_model) = 8, plus learned positions at row position + 2, then layernorm_embedding; per layer (pre-LN, all
    LayerNorms eps 1e-5): x += self_attn(LN(x)) causal; x += encoder_attn(LN(x), encoder output, no mask); x +=
    fc2(gelu(fc1(LN(x)))) (exact erf gelu); then the final layer_norm and the untied lm_head (no bias, no
    final_logits_bias). The encoder output goes into every cross-attention's k/v as is (no norm, no projection)."""
    model, processor = loaded
    dec = model.decoder.model.decoder
    pv = _pixels(processor)
    ids = torch.tensor([[BOS, 40, 7, 300, 129, EOS, 66]])
    with torch.no_grad():
        memory = model.encoder(pv).last_hidden_state
        got = model(pixel_values=pv, decoder_input_ids=ids).logits[0]
        assert memory.shape == (1, IMAGE_TOKENS, D) and dec.embed_tokens.embed_scale == 8.0
        assert dec.embed_positions.offset == 2 and dec.embed_positions.weight.shape[0] == 256 + 2
        x = (
            dec.embed_tokens.weight[ids[0]] * 8.0
            + dec.embed_positions.weight[torch.arange(ids.shape[1]) + 2]
        )
        x = _layer_norm(x, dec.layernorm_embedding)
        for layer in dec.layers:
            x = x + _attend(
                _layer_norm(x, layer.self_attn_layer_norm),
                _layer_norm(x, layer.self_attn_layer_norm),
                layer.self_attn,
                causal=True,
            )
            x = x + _attend(
                _layer_norm(x, layer.encoder_attn_layer_norm),
                memory[0],
                layer.encoder_attn,
                causal=False,
            )
            x = x + layer.fc2(
                torch.nn.functional.gelu(layer.fc1(_layer_norm(x, layer.final_layer_norm)))
            )
        want = _layer_norm(x, dec.layer_norm) @ model.decoder.lm_head.weight.T
    assert model.decoder.lm_head.bias is None and not hasattr(model.decoder, "final_logits_bias")
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_the_image_matters_and_logits_are_spread(loaded):
    model, processor = loaded
    logits = []
    for seed in (0, 3):
        with torch.no_grad():
            logits.append(
                model(
                    pixel_values=_pixels(processor, seed), decoder_input_ids=torch.tensor([[BOS]])
                ).logits
            )
    assert (logits[0] - logits[1]).abs().max() > 0.5
    top = logits[0][0, -1].topk(2).values
    assert logits[0].std() > 0.8 and top[0] - top[1] > 0.05  # greedy decoding is not a near-tie


def test_greedy_generate_starts_from_bos_and_forces_eos_at_the_end(loaded):
    """HF generate feeds decoder_start_token_id = <s> (0) first. Its forced_eos_token_id (2, from the MBart config)
    makes the last of max_new_tokens </s>; without it the same greedy tokens come out, verified step by step with
    full (uncached) forwards."""
    model, processor = loaded
    pv = _pixels(processor)
    with torch.no_grad():
        out = model.generate(pv, max_new_tokens=8, do_sample=False)[0].tolist()
        free = model.generate(pv, max_new_tokens=8, do_sample=False, forced_eos_token_id=None)[0]
        seq = [BOS]
        for _ in range(8):
            seq.append(
                int(
                    model(pixel_values=pv, decoder_input_ids=torch.tensor([seq]))
                    .logits[0, -1]
                    .argmax()
                )
            )
    assert out[0] == BOS and len(out) == 1 + 8 and out[-1] == EOS
    assert EOS not in seq[1:-1] and free.tolist() == seq and out[:-1] == seq[:-1]
    assert len(set(seq[1:])) >= 3  # not one token over and over
    other = model.generate(_pixels(processor, 3), max_new_tokens=8, do_sample=False)[0].tolist()
    assert other != out


def test_seed_determinism_and_sharding(tmp_path):
    kw = {"text_layers": 2}
    a = make_nougat_checkpoint(tmp_path / "a", seed=3, **kw)
    b = make_nougat_checkpoint(tmp_path / "b", seed=3, **kw)
    c = make_nougat_checkpoint(tmp_path / "c", seed=4, **kw)
    assert files_digest(a) == files_digest(b) != files_digest(c)
    for name in ("tokenizer.json", "config.json", "preprocessor_config.json"):
        assert (a / name).read_bytes() == (c / name).read_bytes(), name
    d = make_checkpoint(
        "nougat", tmp_path / "d", seed=3, max_shard_bytes=30_000, layout="transformers", **kw
    )
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((d / "config.json").read_text())["architectures"] == [
        "VisionEncoderDecoderModel"
    ]
    sharded, single = file_tensors(d), file_tensors(a)
    assert sharded.keys() == single.keys() == index["weight_map"].keys()
    assert all(
        torch.equal(sharded[k], single[k]) and sharded[k].dtype == single[k].dtype for k in sharded
    )
    model, info = VisionEncoderDecoderModel.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()) and len(model.decoder.model.decoder.layers) == 2
    half = make_nougat_checkpoint(tmp_path / "e", seed=3, dtype="bfloat16", **kw)
    dtypes = {k: t.dtype for k, t in file_tensors(half).items()}
    assert {t for k, t in dtypes.items() if not k.endswith("relative_position_index")} == {
        torch.bfloat16
    }
    assert {t for k, t in dtypes.items() if k.endswith("relative_position_index")} == {torch.int64}


def test_roofline_counts_the_decoder(tmp_path):
    """lm_shape reads the vision-encoder-decoder's MBart decoder (decoder_* sizes, not its aliases) and counts every
    decoder tensor but the embedding tables and the cross-attention k/v projections (once per page): biases,
    LayerNorms, layernorm_embedding, the untied lm_head; its KV cache is the self-attention's."""
    for preset in ("tiny", "nougat-base"):
        config = nougat_config(preset)
        config.save_pretrained(tmp_path / preset)
        with torch.device("meta"):
            model = VisionEncoderDecoderModel(config)
        elements = sum(
            p.numel()
            for n, p in model.named_parameters()
            if n.startswith("decoder.")
            and "embed_tokens" not in n
            and "embed_positions" not in n
            and "encoder_attn.k_proj" not in n
            and "encoder_attn.v_proj" not in n
        )
        for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
            shape = lm_shape(str(tmp_path / preset), dtype)
            assert shape.weight_bytes == elements * nbytes, (preset, dtype)
        d = config.decoder
        assert (shape.layers, shape.heads, shape.kv_heads, shape.hidden) == (
            d.decoder_layers,
            d.decoder_attention_heads,
            d.decoder_attention_heads,
            d.d_model,
        )
        assert shape.kv_bytes_per_token == 2 * d.decoder_layers * d.d_model * 2


def test_real_preset_has_the_real_shapes():
    """facebook/nougat-base as transformers' conversion script builds it: Swin-B-like encoder at 896x672 (588 tokens
    of width 1024), a 10-layer MBart decoder with 4096 positions and a 50000 vocab; 348.7M parameters."""
    from transformers import DonutSwinConfig, MBartConfig

    cfg = nougat_config("nougat-base")
    enc, dec = cfg.encoder, cfg.decoder
    assert (enc.image_size, enc.patch_size, enc.window_size, enc.embed_dim) == (
        [896, 672],
        4,
        7,
        128,
    )
    assert (enc.depths, enc.num_heads, enc.hidden_size) == ([2, 2, 14, 2], [4, 8, 16, 32], 1024)
    assert (dec.d_model, dec.decoder_layers, dec.decoder_attention_heads, dec.decoder_ffn_dim) == (
        1024,
        10,
        16,
        4096,
    )
    assert (
        dec.vocab_size,
        dec.max_position_embeddings,
        dec.scale_embedding,
        dec.tie_word_embeddings,
    ) == (50000, 4096, True, False)
    assert (dec.bos_token_id, dec.pad_token_id, dec.eos_token_id, dec.forced_eos_token_id) == (
        0,
        1,
        2,
        2,
    )
    assert (cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert str(dec.dtype).endswith("bfloat16") and str(enc.dtype).endswith("bfloat16")
    s = nougat_sizes("nougat-base")
    assert s.stage_grids == [(224, 168), (112, 84), (56, 42), (28, 21)] and s.image_tokens == 588
    # every size but the dtype (and the token ids and init std we set) is what the conversion script writes
    ref_enc = DonutSwinConfig(
        image_size=[896, 672],
        patch_size=4,
        depths=[2, 2, 14, 2],
        num_heads=[4, 8, 16, 32],
        window_size=7,
        embed_dim=128,
    )
    ref_dec = MBartConfig(
        is_decoder=True,
        is_encoder_decoder=False,
        add_cross_attention=True,
        decoder_layers=10,
        max_position_embeddings=4096,
        vocab_size=50000,
        scale_embedding=True,
        add_final_layer_norm=True,
        tie_word_embeddings=False,
    )
    ignore = {
        "dtype",
        "architectures",
        "decoder_start_token_id",
        "_name_or_path",
        "transformers_version",
    }
    for ours, ref in ((enc, ref_enc), (dec, ref_dec)):
        a, b = ours.to_dict(), ref.to_dict()
        assert {k: a[k] for k in a if k not in ignore} == {k: b[k] for k in b if k not in ignore}
    specs = {name: shape for name, shape, kind in _param_specs(cfg, s) if kind != "rel_pos_index"}
    assert specs[EMBED] == specs[LM_HEAD] == (50000, 1024)
    assert specs["decoder.model.decoder.embed_positions.weight"] == (4098, 1024)
    assert specs[
        "encoder.encoder.layers.3.blocks.1.attention.self.relative_position_bias_table"
    ] == (13 * 13, 32)
    assert sum(math.prod(v) for v in specs.values()) == 348_687_992
    processor, image_processor = build_nougat_processor(s)
    assert image_processor.size.height == 896 and image_processor.size.width == 672
    tok = processor.tokenizer
    assert len(tok) == 50000 and (
        tok.bos_token_id,
        tok.pad_token_id,
        tok.eos_token_id,
        tok.unk_token_id,
    ) == (0, 1, 2, 3)


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown nougat preset"):
        nougat_config("nougat-small")
    with pytest.raises(TypeError, match="unknown nougat overrides"):
        nougat_config(num_layers=2)
    with pytest.raises(ValueError, match="must equal the Swin output width"):
        nougat_config(text_hidden=96, text_heads=4)
    with pytest.raises(ValueError, match="window_size"):
        nougat_config(window_size=4)
    with pytest.raises(ValueError, match="multiples of"):
        nougat_config(image_height=70)
    with pytest.raises(ValueError, match="must divide"):
        nougat_config(text_heads=3)
    with pytest.raises(ValueError, match="layout"):
        make_nougat_checkpoint(tmp_path, layout="facebook")
