"""Random BLIP-2 Flan-T5 checkpoints: transformers loads every tensor, the processor and generate behave as with
Salesforce/blip2-flan-t5-xl, files are deterministic, the real preset has the published shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor, Blip2ForConditionalGeneration

from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.blip2 import _param_specs, blip2_config, blip2_sizes, make_blip2_checkpoint
from mmserve.testing.tokenizer import t5_vocab
from tests.checkpoint_files import file_tensors, files_digest

PROMPT = "Question: what is this? Answer:"
TIED = ("language_model.encoder.embed_tokens.weight", "language_model.decoder.embed_tokens.weight")
TEXT_FFN_KEYS = ("intermediate.dense", "output.dense", "output.LayerNorm")


@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory) -> dict[str, str]:
    return {
        layout: str(
            make_blip2_checkpoint(
                tmp_path_factory.mktemp(f"blip2_t5_{layout}"), preset="tiny-t5", layout=layout
            )
        )
        for layout in ("transformers", "hub")
    }


@pytest.fixture(scope="module")
def loaded(t5_dirs):
    model = Blip2ForConditionalGeneration.from_pretrained(t5_dirs["transformers"]).eval()
    return model, AutoProcessor.from_pretrained(t5_dirs["transformers"])


def test_transformers_loads_every_tensor_of_the_tiny_t5_checkpoint(t5_dirs, loaded):
    model, info = Blip2ForConditionalGeneration.from_pretrained(
        t5_dirs["transformers"], output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    on_disk, state = file_tensors(t5_dirs["transformers"]), model.state_dict()
    assert set(on_disk) == set(state) - set(TIED)  # the embed_tokens tables are `shared` itself
    assert all(torch.equal(on_disk[k], v) for k, v in state.items() if k in on_disk)
    lm = model.language_model
    assert (
        lm.encoder.embed_tokens.weight is lm.shared.weight
        and lm.decoder.embed_tokens.weight is lm.shared.weight
    )
    assert not torch.equal(lm.lm_head.weight, lm.shared.weight)  # flan-t5 unties its head ...
    assert lm.config.scale_decoder_outputs is False  # ... and does not scale by d_model**-0.5
    t = model.config.text_config
    assert (
        t.model_type,
        t.vocab_size,
        t.d_model,
        t.d_kv,
        t.num_heads,
        t.d_ff,
        t.num_layers,
        t.num_decoder_layers,
    ) == ("t5", 504, 64, 16, 4, 128, 2, 2)
    assert (t.feed_forward_proj, t.dense_act_fn, t.is_gated_act, t.layer_norm_epsilon) == (
        "gated-gelu",
        "gelu_new",
        True,
        1e-6,
    )
    assert (t.relative_attention_num_buckets, t.relative_attention_max_distance) == (32, 128)
    assert (t.pad_token_id, t.eos_token_id, t.decoder_start_token_id) == (0, 1, 0)
    assert (
        model.config.image_token_index,
        model.config.num_query_tokens,
        model.config.is_encoder_decoder,
    ) == (500, 32, True)
    # the relative position bias lives in block 0 of each stack only; RMS norm scales are 1 + noise
    names = set(on_disk)
    biases = sorted(n for n in names if "relative_attention_bias" in n)
    assert biases == [
        f"language_model.{s}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        for s in ("decoder", "encoder")
    ]
    assert on_disk[biases[0]].shape == (32, 4) and 0.3 < on_disk[biases[0]].std() < 0.7
    norm = on_disk["language_model.decoder.final_layer_norm.weight"]
    assert 0.8 < norm.mean() < 1.2 and norm.std() > 0.01
    assert {
        "language_model.shared.weight",
        "language_model.lm_head.weight",
        "language_model.decoder.block.1.layer.1.EncDecAttention.q.weight",
        "language_model.decoder.block.1.layer.2.DenseReluDense.wi_0.weight",
        "language_model.decoder.block.1.layer.2.DenseReluDense.wi_1.weight",
        "language_model.decoder.block.1.layer.2.DenseReluDense.wo.weight",
        "language_model.encoder.block.1.layer.1.layer_norm.weight",
    } <= names
    assert not any(n.endswith(".bias") for n in names if n.startswith("language_model."))
    gen = json.loads((Path(t5_dirs["transformers"]) / "generation_config.json").read_text())
    assert (gen["decoder_start_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (0, 1, 0)
    assert "bos_token_id" not in gen


def test_transformers_layout_is_what_save_pretrained_writes(loaded, t5_dirs, tmp_path):
    model, _ = loaded
    model.save_pretrained(tmp_path)
    ours, theirs = file_tensors(t5_dirs["transformers"]), file_tensors(tmp_path)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    saved = json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert (saved["tie_word_embeddings"], saved["scale_decoder_outputs"]) == (True, False)


def test_hub_layout_adds_the_qformer_extras_and_a_transformers_4_text_config(t5_dirs, loaded):
    model, info = Blip2ForConditionalGeneration.from_pretrained(
        t5_dirs["hub"], output_loading_info=True
    )
    assert not info["missing_keys"]
    assert info["unexpected_keys"] and all(
        any(k in u for k in TEXT_FFN_KEYS) for u in info["unexpected_keys"]
    )
    text = json.loads((Path(t5_dirs["hub"]) / "config.json").read_text())["text_config"]
    assert text["tie_word_embeddings"] is False and "scale_decoder_outputs" not in text
    assert model.language_model.config.scale_decoder_outputs is False
    a, b = loaded[0].state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_processor_puts_32_image_tokens_before_the_text_and_its_eos(loaded):
    model, processor = loaded
    tok = processor.tokenizer
    assert type(tok).__name__ == "T5Tokenizer" and tok.bos_token_id is None
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.convert_tokens_to_ids(["<extra_id_0>", "<extra_id_99>", "<image>"]) == [
        499,
        400,
        500,
    ]
    assert len(tok) == 501 <= model.config.text_config.vocab_size
    enc = processor(text=PROMPT, images=[make_test_image(0)], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    text_ids = tok(PROMPT).input_ids
    assert text_ids[-1] == tok.eos_token_id and tok.unk_token_id not in text_ids
    assert ids == [500] * 32 + text_ids
    assert tok.convert_ids_to_tokens(text_ids) == [
        "▁Question:",
        "▁w",
        "h",
        "at",
        "▁is",
        "▁this",
        "?",
        "▁Answer:",
        "</s>",
    ]
    assert enc["attention_mask"].all() and enc["pixel_values"].shape == (1, 3, 28, 28)
    assert tok.decode(text_ids, skip_special_tokens=True) == PROMPT


def test_hf_greedy_generate_starts_from_pad_and_depends_on_image_and_relative_bias(loaded):
    model, processor = loaded
    enc = processor(text=PROMPT, images=[make_test_image(0)], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
        first = model(**enc, decoder_input_ids=torch.tensor([[0]])).logits[0, -1]
        other = model.generate(
            **processor(text=PROMPT, images=[make_test_image(1)], return_tensors="pt"),
            max_new_tokens=8,
            do_sample=False,
        )
        bias = (
            model.language_model.encoder.block[0]
            .layer[0]
            .SelfAttention.relative_attention_bias.weight
        )
        saved = bias.detach().clone()
        bias.data.zero_()
        try:
            no_bias = model.generate(**enc, max_new_tokens=8, do_sample=False)
        finally:
            bias.data.copy_(saved)
    # the decoder's output starts with decoder_start_token_id (<pad> = 0); 8 new tokens follow, no </s> forced
    assert out.shape == (1, 9) and out[0, 0].item() == 0
    assert out[0, 1].item() == first.argmax().item()
    top2 = first.topk(2).values
    assert (
        first.std() > 1.0 and top2[0] - top2[1] > 0.5
    )  # spread logits: greedy ties are not an issue
    assert not torch.equal(out, other) and not torch.equal(out, no_bias)


def test_same_seed_gives_identical_files(tmp_path):
    a = make_blip2_checkpoint(tmp_path / "a", preset="tiny-t5", seed=5, max_shard_bytes=300_000)
    b = make_checkpoint("blip2", tmp_path / "b", preset="tiny-t5", seed=5, max_shard_bytes=300_000)
    c = make_blip2_checkpoint(tmp_path / "c", preset="tiny-t5", seed=6)
    assert len(list(a.glob("model-*.safetensors"))) > 1
    assert files_digest(a) == files_digest(b) != files_digest(c)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "processor_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes() == (c / name).read_bytes(), name
    assert t5_vocab(400, 100) == t5_vocab(400, 100)


def test_blip2_flan_t5_xl_preset_has_the_published_config():
    cfg = blip2_config("blip2-flan-t5-xl")
    t, v, q = cfg.text_config, cfg.vision_config, cfg.qformer_config
    assert (
        t.model_type,
        t.vocab_size,
        t.d_model,
        t.d_kv,
        t.num_heads,
        t.d_ff,
        t.num_layers,
        t.num_decoder_layers,
    ) == ("t5", 32128, 2048, 64, 32, 5120, 24, 24)
    assert (
        t.feed_forward_proj,
        t.relative_attention_num_buckets,
        t.relative_attention_max_distance,
    ) == ("gated-gelu", 32, 128)
    assert (
        t.layer_norm_epsilon,
        t.scale_decoder_outputs,
        t.decoder_start_token_id,
        t.pad_token_id,
        t.eos_token_id,
    ) == (1e-6, False, 0, 0, 1)
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
    assert (cfg.num_query_tokens, cfg.image_token_index, cfg.dtype, t.dtype) == (
        32,
        32100,
        "bfloat16",
        "bfloat16",
    )
    vocab = t5_vocab(32000, 100)
    assert len(vocab) == 32100 and vocab[:3] == [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    assert (vocab[32000][0], vocab[-1][0]) == ("<extra_id_99>", "<extra_id_0>")
    specs = _param_specs(cfg, blip2_sizes("blip2-flan-t5-xl"), "transformers")
    assert (
        3.93e9 < sum(torch.Size(shape).numel() for _, shape, _ in specs) < 3.95e9
    )  # the hub's 3.94B


def test_unknown_text_model_is_rejected():
    with pytest.raises(ValueError, match="text_model"):
        blip2_config("tiny-t5", text_model="llama")
