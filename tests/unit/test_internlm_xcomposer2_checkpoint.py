"""Random InternLM-XComposer2-VL checkpoints: the published on-disk layout (remote-code config.json, .bin shards
with an index, InternLM2's packed wqkv, Plora tensors, the CLIP tower's names), seeded bytes, overrides, the prompt
id convention, the Plora LoRA task files, and the eager reference that the parity tests use as the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import CLIPVisionModel, PreTrainedTokenizerFast

from mmserve.testing import make_checkpoint, make_test_image
from mmserve.testing.internlm_xcomposer2 import (
    INDEX,
    VIT_PREFIX,
    deinterleave_wqkv,
    interleave_wqkv,
    internlm_xcomposer2_config,
    load_xcomposer2_weights,
    param_specs,
    prompt_ids,
    tokens_per_image,
    vision_tower_config,
    wqkv_parts,
    xcomposer2_sizes,
)
from mmserve.testing.lora import DECODER_TARGETS
from tests.parity.xcomposer2_reference import (
    _load,
    preprocess,
    reference_greedy,
    reference_prompt_logits,
)

BOS, EOS, UNK, IM_END, IM_START = 1, 2, 0, 398, 399  # tiny preset ids
N_IMG = 4  # (28 / 14) ** 2
PROMPT = (
    "[UNUSED_TOKEN_146]system\nYou are an AI assistant.[UNUSED_TOKEN_145]\n"
    "[UNUSED_TOKEN_146]user\n<ImageHere>What is in this image?[UNUSED_TOKEN_145]\n"
    "[UNUSED_TOKEN_146]assistant\n"
)
TEXT_PROMPT = PROMPT.replace("<ImageHere>", "")
PER_LAYER = 5 * 3 + 2  # five PLoRA linears (weight, Plora_A, Plora_B), two norms


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("xcomposer2")
    return make_checkpoint("internlm_xcomposer2", root / "model", lora_dir=root / "lora")


@pytest.fixture(scope="module")
def weights(ckpt) -> dict[str, torch.Tensor]:
    return load_xcomposer2_weights(ckpt)


@pytest.fixture(scope="module")
def tokenizer(ckpt) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(ckpt)


def test_the_published_layout_on_disk(ckpt, weights, tokenizer):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["InternLMXComposer2ForCausalLM"]
    assert cfg["model_type"] == "internlmxcomposer2"
    assert cfg["auto_map"]["AutoModelForCausalLM"].startswith("modeling_internlm_xcomposer2.")
    expected = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=400)
    expected.update(num_hidden_layers=2, img_size=28, bias=False, rope_scaling=None)
    expected.update(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS, torch_dtype="float32")
    assert {k: cfg[k] for k in expected} == expected
    assert {
        "intermediate_size",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    } <= cfg.keys()
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS, IM_END]

    index = json.loads((ckpt / INDEX).read_text())
    shards = sorted(ckpt.glob("pytorch_model-*.bin"))
    assert len(shards) >= 2
    assert sorted(set(index["weight_map"].values())) == [f.name for f in shards]
    seen = {}
    for f in shards:
        for name, t in torch.load(f, weights_only=True).items():
            assert index["weight_map"][name] == f.name
            seen[name] = t
    assert seen.keys() == index["weight_map"].keys() == weights.keys()
    total = sum(t.numel() * t.element_size() for t in seen.values())
    assert index["metadata"]["total_size"] == total

    vit = {k for k in weights if k.startswith(VIT_PREFIX)}
    proj = {f"vision_proj.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")}
    text = {"model.tok_embeddings.weight", "model.norm.weight", "output.weight"}
    assert len(weights) == len(vit) + len(proj) + len(text) + 2 * PER_LAYER
    assert proj | text <= weights.keys()
    assert weights["model.layers.1.attention.wqkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert weights["model.layers.1.attention.wqkv.Plora_A.weight"].shape == (8, 64)
    assert weights["model.layers.1.feed_forward.w2.Plora_B.weight"].shape == (64, 8)
    assert weights[f"{VIT_PREFIX}embeddings.position_embedding.weight"].shape == (N_IMG + 1, 32)
    plora_b = [k for k in weights if "Plora_B" in k]
    assert len(plora_b) == 10 and all(weights[k].std() > 0.05 for k in plora_b)  # not PEFT's zeros
    # the tower's tensors are transformers' CLIPVisionModel's, strictly
    model = CLIPVisionModel(vision_tower_config(cfg))
    model.load_state_dict({k.removeprefix(VIT_PREFIX): weights[k] for k in vit})

    assert len(tokenizer) <= cfg["vocab_size"]
    specials = (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert specials == (UNK, BOS, EOS)
    ids = tokenizer.convert_tokens_to_ids(["[UNUSED_TOKEN_145]", "[UNUSED_TOKEN_146]"])
    assert ids == [IM_END, IM_START]
    assert len(tokenizer("<ImageHere>", add_special_tokens=False)["input_ids"]) > 1  # no such token


def test_a_seed_gives_byte_identical_shards(ckpt, tmp_path):
    again = make_checkpoint("internlm_xcomposer2", tmp_path / "again")
    other = make_checkpoint("internlm_xcomposer2", tmp_path / "other", seed=1)
    for f in sorted(ckpt.glob("pytorch_model*")):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    first, second = load_xcomposer2_weights(ckpt), load_xcomposer2_weights(other)
    assert not torch.equal(first["output.weight"], second["output.weight"])


def test_overrides_and_presets():
    cfg = internlm_xcomposer2_config(text_layers=3, image_size=42)
    assert cfg.architectures == ["InternLMXComposer2ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.img_size, tokens_per_image(cfg)) == (3, 42, 9)
    with pytest.raises(TypeError, match=r"unknown internlm_xcomposer2 overrides \['nope'\]"):
        internlm_xcomposer2_config(nope=1)
    with pytest.raises(ValueError, match="unknown internlm_xcomposer2 preset"):
        internlm_xcomposer2_config("big")
    with pytest.raises(ValueError, match="text_kv_heads 3 must divide text_heads 4"):
        internlm_xcomposer2_config(text_kv_heads=3)

    real = internlm_xcomposer2_config("internlm-xcomposer2-vl-7b")
    assert (real.hidden_size, real.intermediate_size, real.num_hidden_layers) == (4096, 14336, 32)
    assert (real.num_attention_heads, real.num_key_value_heads, real.vocab_size) == (32, 8, 92544)
    assert (real.img_size, tokens_per_image(real), str(real.dtype)) == (490, 1225, "torch.float16")
    assert getattr(real, "vision_config", None) is None  # the published config has none: ViT-L/14
    vc = vision_tower_config(real)
    tower = (vc.hidden_size, vc.num_hidden_layers, vc.num_attention_heads, vc.image_size)
    assert tower == (1024, 24, 16, 490)
    specs = param_specs(xcomposer2_sizes("internlm-xcomposer2-vl-7b"))
    shapes = {name: shape for name, shape, _ in specs}
    assert shapes["model.layers.31.attention.wqkv.weight"] == (6144, 4096)
    assert shapes["model.layers.31.attention.wqkv.Plora_A.weight"] == (256, 4096)
    assert shapes["model.layers.31.feed_forward.w2.Plora_B.weight"] == (4096, 256)
    assert shapes[f"{VIT_PREFIX}embeddings.position_embedding.weight"] == (1226, 1024)
    assert shapes["vision_proj.0.weight"] == (4096, 1024)


def test_wqkv_interleave_round_trips(weights):
    s = xcomposer2_sizes()
    for name in (
        "model.layers.0.attention.wqkv.weight",
        "model.layers.1.attention.wqkv.Plora_B.weight",
    ):
        packed = weights[name]
        drawn = wqkv_parts(name, tuple(packed.shape), s, seed=0)
        for got, want in zip(deinterleave_wqkv(packed, 4, 2), drawn):
            assert torch.equal(got, want), name
        assert torch.equal(interleave_wqkv(*drawn, kv_heads=2), packed)
    # rows as [kv_heads, q per kv + 2, head_dim]: each kv head's queries, then its key, then its value
    q, k, v = (
        torch.arange(4.0)[:, None],
        torch.arange(10.0, 12.0)[:, None],
        torch.arange(20.0, 22.0)[:, None],
    )
    assert interleave_wqkv(q, k, v, kv_heads=2).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_prompt_ids_convention(tokenizer):
    ids, spans = prompt_ids(tokenizer, PROMPT, N_IMG)  # every part with BOS, as interleav_wrap_chat
    before, after = PROMPT.split("<ImageHere>")
    head = tokenizer(before)["input_ids"]
    tail = tokenizer(after)["input_ids"]
    assert head[0] == BOS and tail[0] == BOS
    assert ids == head + [UNK] * N_IMG + tail and spans == [(len(head), N_IMG)]
    first_only, _ = prompt_ids(tokenizer, PROMPT, N_IMG, bos_every_part=False)  # interleav_wrap
    assert first_only == head + [UNK] * N_IMG + tail[1:]
    assert prompt_ids(tokenizer, TEXT_PROMPT, N_IMG) == (tokenizer(TEXT_PROMPT)["input_ids"], [])
    ids, spans = prompt_ids(tokenizer, "<ImageHere><ImageHere>hi", N_IMG)
    assert ids[: 2 * N_IMG] == [UNK] * 2 * N_IMG and ids[2 * N_IMG] == BOS
    assert spans == [(0, N_IMG), (N_IMG, N_IMG)]
    ids, _ = prompt_ids(tokenizer, "a<ImageHere>b", N_IMG)
    assert ids[0] == BOS and ids[2 + N_IMG] == BOS


def test_preprocess_is_torchvisions_vis_processor():
    transforms = pytest.importorskip("torchvision.transforms")
    vis_processor = transforms.Compose(
        [
            transforms.Resize((28, 28), interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.ToTensor(),
            transforms.Normalize(
                (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
            ),
        ]
    )
    image = make_test_image(3, (61, 37))
    got = preprocess(image, 28)
    assert got.shape == (3, 28, 28) and got.dtype == torch.float32
    torch.testing.assert_close(got, vis_processor(image), rtol=0, atol=1e-6)


def test_the_reference_is_deterministic(ckpt, tokenizer):
    image = make_test_image(0)
    ids, new, logprobs = reference_greedy(str(ckpt), PROMPT, [image], 6)
    assert ids == prompt_ids(tokenizer, PROMPT, N_IMG)[0]
    assert len(new) == 6 and logprobs.shape == (6, 400) and logprobs.dtype == torch.float32
    assert torch.isinf(logprobs[:, [EOS, IM_END]]).all()
    assert new == logprobs.argmax(-1).tolist()
    _load.cache_clear()  # a fresh load too
    again = reference_greedy(str(ckpt), PROMPT, [image], 6)
    assert again[:2] == (ids, new) and torch.equal(again[2], logprobs)
    with pytest.raises(ValueError, match="1 <ImageHere> but 0 images"):
        reference_greedy(str(ckpt), PROMPT, None, 1)


def _zero_plora(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("pytorch_model-*.bin"):
        state = torch.load(f, weights_only=True)
        torch.save({k: torch.zeros_like(v) if "Plora" in k else v for k, v in state.items()}, f)
    return dst


def test_the_partial_lora_changes_image_prompts_only(ckpt, tmp_path):
    plain = _zero_plora(ckpt, tmp_path / "no-plora")
    image = make_test_image(0)
    ids, with_lora = reference_prompt_logits(str(ckpt), PROMPT, [image])
    _, without = reference_prompt_logits(str(plain), PROMPT, [image])
    start = ids.index(UNK)
    assert torch.equal(with_lora[:start], without[:start])  # causal: rows before the image
    changed = (with_lora[start:] - without[start:]).abs().amax(-1)
    assert changed.min() > 1e-2  # every row from the image on
    greedy = [reference_greedy(str(d), PROMPT, [image], 4)[1] for d in (ckpt, plain)]
    assert greedy[0] != greedy[1]
    text_ids, text_with = reference_prompt_logits(str(ckpt), TEXT_PROMPT, None)
    _, text_without = reference_prompt_logits(str(plain), TEXT_PROMPT, None)
    assert UNK not in text_ids and torch.equal(text_with, text_without)
    a, b = (reference_greedy(str(d), TEXT_PROMPT, None, 4) for d in (ckpt, plain))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


def test_the_lora_task_is_the_plora_weights(ckpt, weights):
    lora = ckpt.parent / "lora"
    adapter = json.loads((lora / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"], adapter["peft_type"]) == (8, 8, "LORA")
    assert set(adapter["target_modules"]) == set(DECODER_TARGETS)
    tensors = load_file(str(lora / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2
    src, dst = "model.layers.1.", "base_model.model.model.layers.1."
    q, k, v = deinterleave_wqkv(weights[f"{src}attention.wqkv.Plora_B.weight"], 4, 2)
    for target, b in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        assert torch.equal(tensors[f"{dst}self_attn.{target}.lora_B.weight"], b)
        a = weights[f"{src}attention.wqkv.Plora_A.weight"]
        assert torch.equal(tensors[f"{dst}self_attn.{target}.lora_A.weight"], a)
    pairs = [("attention.wo", "self_attn.o_proj"), ("feed_forward.w1", "mlp.gate_proj")]
    pairs += [("feed_forward.w3", "mlp.up_proj"), ("feed_forward.w2", "mlp.down_proj")]
    for name, target in pairs:
        for x in "AB":
            want = weights[f"{src}{name}.Plora_{x}.weight"]
            assert torch.equal(tensors[f"{dst}{target}.lora_{x}.weight"], want)
    lora_weights = np.load(lora / "model.lora_weights.npy")
    lora_config = np.load(lora / "model.lora_config.npy")
    assert lora_weights.dtype == np.float16 and lora_config.dtype == np.int32
    assert lora_weights.shape[:2] == lora_config.shape[:2] == (1, 14) and lora_config.shape[2] == 3
    rows = {tuple(r[:2]): i for i, r in enumerate(lora_config[0].tolist())}
    assert sorted(rows) == [(m, layer) for m in range(1, 8) for layer in (0, 1)]
    assert set(lora_config[0, :, 2].tolist()) == {8}
    # module 1 (q) of layer 1: A [8, 64] then B [64, 8] flattened, alpha / r = 1 already in B
    row = torch.from_numpy(lora_weights[0, rows[(1, 1)]]).float()
    want = torch.cat([weights[f"{src}attention.wqkv.Plora_A.weight"].flatten(), q.flatten()])
    torch.testing.assert_close(row[: want.numel()], want.half().float(), rtol=0, atol=0)
