"""Random NeVA ``.nemo`` checkpoints: the archive reader reads them back (tar, gzip, extracted, tensor-parallel
shards) and refuses what it does not support by name; the eager reference runs both presets deterministically
and equals transformers' Nemotron (layernorm1p, squared-relu, partial rotary, GQA) and Llama (rmsnorm, swiglu)
decoders on the same weights."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer
from transformers import (
    CLIPVisionModel,
    LlamaConfig,
    LlamaForCausalLM,
    NemotronConfig,
    NemotronForCausalLM,
    SiglipVisionModel,
)

from mmserve.models.nemo_archive import (
    iter_nemo_weights,
    merge_tp_shards,
    nemo_file,
    nemo_tokenizer_file,
    read_nemo_config,
    vision_tower_dir,
)
from mmserve.testing import checkpoint_writers, make_test_image
from mmserve.testing.neva import (
    EXTRA_IDS,
    NEMO_NAME,
    chat_prompt,
    make_neva_checkpoint,
    make_neva_weights,
    neva_config,
    neva_sizes,
    neva_token_ids,
    neva_weight_specs,
    prompt_ids,
    tokenizer_json,
    tokens_per_image,
)
from tests.parity.neva_reference import NevaReference, load_reference, reference_greedy

YAML_KEYS = (
    "hidden_size ffn_hidden_size num_layers num_attention_heads num_query_groups kv_channels normalization "
    "layernorm_epsilon activation bias position_embedding_type rotary_percentage rotary_base "
    "share_embeddings_and_output_weights max_position_embeddings mcore_gpt mm_cfg data tokenizer"
).split()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("neva")
    return {
        "tiny": make_neva_checkpoint(root / "tiny", preset="tiny", seed=0, progress=False),
        "tiny-swiglu": make_neva_checkpoint(
            root / "swiglu", preset="tiny-swiglu", seed=1, compress=True, progress=False
        ),
    }


def _members(nemo: Path) -> dict[str, bytes]:
    with tarfile.open(nemo, "r:*") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _write_tar(path: Path, members: dict[str, bytes], gz: bool = False) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _saved(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def test_archive_reads_back_yaml_weights_and_tokenizer(ckpts, tmp_path):
    for preset, d in ckpts.items():
        s = neva_sizes(preset)
        names = set(_members(d / NEMO_NAME))
        assert "./model_config.yaml" in names and "./model_weights.ckpt" in names
        cfg = read_nemo_config(d)
        assert all(k in cfg for k in YAML_KEYS), set(YAML_KEYS) - set(cfg)
        assert cfg["mm_cfg"]["vision_encoder"]["from_pretrained"] == "vision_tower"
        assert cfg["mm_cfg"]["mm_mlp_adapter_type"] == "mlp2x_gelu"
        assert cfg["data"]["image_token_len"] == tokens_per_image(s)
        assert cfg["tokenizer"]["library"] == "tokenizers"
        assert f"./{cfg['tokenizer']['model'][len('nemo:') :]}" in names
        weights = dict(iter_nemo_weights(d))  # _extra_state (BytesIO) skipped
        expected = make_neva_weights(s, seed=0 if preset == "tiny" else 1)
        assert list(weights) == list(expected)
        assert all(torch.equal(weights[k], expected[k]) for k in expected)
        qkv = weights["model.decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == ((s.heads + 2 * (s.query_groups or s.heads)) * 16, s.hidden)
        tok = Tokenizer.from_file(str(nemo_tokenizer_file(d, tmp_path / preset)))
        ids = neva_token_ids(s.text_vocab)
        assert [tok.token_to_id(t) for t in EXTRA_IDS] == [ids[t] for t in EXTRA_IDS]
        assert tok.get_vocab_size() == neva_config(preset).vocab_size == 416
        assert tok.encode("Hello").ids[0] != ids["bos"]  # no BOS added
        tower_cls = SiglipVisionModel if s.vision_model == "siglip" else CLIPVisionModel
        _, info = tower_cls.from_pretrained(vision_tower_dir(d), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_gzip_plain_and_extracted_read_the_same(ckpts, tmp_path):
    d = ckpts["tiny"]
    members = _members(d / NEMO_NAME)
    gz = _write_tar(tmp_path / "gz.nemo", members, gz=True)
    plain = _write_tar(tmp_path / "plain.nemo", {k[2:]: v for k, v in members.items()})  # no "./"
    extracted = tmp_path / "extracted"
    for name, data in members.items():
        (extracted / name).parent.mkdir(parents=True, exist_ok=True)
        (extracted / name).write_bytes(data)
    ref = dict(iter_nemo_weights(d / NEMO_NAME))
    for path in (gz, plain, extracted):
        got = dict(iter_nemo_weights(path))
        assert list(got) == list(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
        assert read_nemo_config(path) == read_nemo_config(d)
    assert nemo_file(d) == d / NEMO_NAME and nemo_file(extracted) == extracted


def _split_tp(state: dict, tp: int, gated: bool) -> list[dict]:
    """Megatron's tensor-parallel split, written out here: column-parallel qkv / fc1 by rows (GLU fc1 per half),
    row-parallel proj / fc2 by columns, embeddings by vocab, the rest replicated."""
    shards = [{} for _ in range(tp)]
    for k, v in state.items():
        if ".layer_norm_" in k or "layernorm" in k or "mm_projector" in k:
            parts = [v] * tp
        elif k.endswith("linear_fc1.weight") and gated:
            gate, up = v.chunk(2)
            parts = [torch.cat(p) for p in zip(gate.chunk(tp), up.chunk(tp))]
        elif k.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight")):
            parts = v.chunk(tp)
        elif k.endswith("output_layer.weight"):
            parts = v.chunk(tp)
        elif k.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = v.chunk(tp, dim=1)
        else:
            raise AssertionError(k)
        for shard, part in zip(shards, parts):
            shard[k] = part.clone()
    return shards


def test_tensor_parallel_shards_are_merged(ckpts, tmp_path):
    for preset, d in ckpts.items():
        members = _members(d / NEMO_NAME)
        state = dict(iter_nemo_weights(d))
        sharded = {k: v for k, v in members.items() if not k.endswith("model_weights.ckpt")}
        gated = neva_sizes(preset).activation == "swiglu"
        for rank, shard in enumerate(_split_tp(state, 2, gated)):
            sharded[f"./mp_rank_{rank:02d}/model_weights.ckpt"] = _saved(shard)
        got = dict(iter_nemo_weights(_write_tar(tmp_path / f"{preset}-tp2.nemo", sharded)))
        assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="cannot merge the tensor-parallel shards of 'x.unknown'"):
        merge_tp_shards("x.unknown", [torch.zeros(2), torch.ones(2)], gated=False)


def test_missing_and_unsupported_layouts_give_clear_errors(ckpts, tmp_path):
    members = _members(ckpts["tiny"] / NEMO_NAME)
    cfg, weights = members["./model_config.yaml"], members["./model_weights.ckpt"]
    no_yaml = _write_tar(tmp_path / "no_yaml.nemo", {"./model_weights.ckpt": weights})
    with pytest.raises(ValueError, match=r"no_yaml\.nemo: no model_config\.yaml"):
        read_nemo_config(no_yaml)
    with pytest.raises(ValueError, match=r"no_yaml\.nemo: no model_config\.yaml"):
        list(iter_nemo_weights(no_yaml))
    no_weights = _write_tar(tmp_path / "no_weights.nemo", {"./model_config.yaml": cfg})
    with pytest.raises(ValueError, match=r"no_weights\.nemo: no model_weights\.ckpt .*supported"):
        list(iter_nemo_weights(no_weights))
    with pytest.raises(ValueError, match=r"tokenizer file .* is not in the archive"):
        nemo_tokenizer_file(no_weights, tmp_path)
    dist = _write_tar(
        tmp_path / "dist.nemo",
        {
            "./model_config.yaml": cfg,
            "./model_weights/metadata.json": b"{}",
            "./model_weights/common.pt": b"",
        },
    )
    with pytest.raises(ValueError, match=r"distributed checkpoint.*dcp_to_torch"):
        list(iter_nemo_weights(dist))
    pp = _write_tar(
        tmp_path / "pp.nemo",
        {
            "./model_config.yaml": cfg,
            "./tp_rank_00_pp_rank_000/model_weights.ckpt": weights,
            "./tp_rank_00_pp_rank_001/model_weights.ckpt": weights,
        },
    )
    with pytest.raises(ValueError, match="pipeline-parallel shards .* not supported"):
        list(iter_nemo_weights(pp))
    gpt = yaml.safe_load(cfg)
    del gpt["mm_cfg"]
    plain_gpt = _write_tar(
        tmp_path / "gpt.nemo", {"./model_config.yaml": yaml.safe_dump(gpt).encode()}
    )
    with pytest.raises(ValueError, match=r"gpt\.nemo: .*no mm_cfg; not a NeVA"):
        read_nemo_config(plain_gpt)
    (tmp_path / "junk.nemo").write_bytes(b"not a tar")
    with pytest.raises(ValueError, match="not a .nemo archive"):
        read_nemo_config(tmp_path / "junk.nemo")


def test_a_seed_gives_identical_weights(ckpts, tmp_path):
    again = make_neva_checkpoint(tmp_path / "again", preset="tiny", seed=0, progress=False)
    first, second = dict(iter_nemo_weights(ckpts["tiny"])), dict(iter_nemo_weights(again))
    assert all(torch.equal(first[k], second[k]) for k in first)
    for f in ("model.safetensors", "config.json", "preprocessor_config.json"):
        assert (again / "vision_tower" / f).read_bytes() == (
            ckpts["tiny"] / "vision_tower" / f
        ).read_bytes()
    other = make_neva_weights(neva_sizes("tiny"), seed=5)
    assert not torch.equal(other["model.output_layer.weight"], first["model.output_layer.weight"])


def test_prompt_convention():
    s = neva_sizes("tiny")
    tok = Tokenizer.from_str(tokenizer_json(s.text_vocab))
    prompt = chat_prompt("What is this?")
    assert prompt == (
        "<extra_id_0>System\n\n<extra_id_1>User\n<image>\nWhat is this?\n<extra_id_1>Assistant\n"
    )
    ids, spans = prompt_ids(tok, prompt, 9)
    pre = tok.encode("<extra_id_0>System\n\n<extra_id_1>User\n", add_special_tokens=False).ids
    post = tok.encode("\nWhat is this?\n<extra_id_1>Assistant\n", add_special_tokens=False).ids
    placeholder = neva_token_ids(s.text_vocab)["placeholder"]
    assert ids == pre + [placeholder] * 9 + post and spans == [(len(pre), 9)]
    assert ids[0] == neva_token_ids(s.text_vocab)["<extra_id_0>"]  # no BOS
    assert prompt_ids(tok, chat_prompt("Hi", images=0), 9)[1] == []
    two, spans2 = prompt_ids(tok, "<image><image>x", 4)
    assert spans2 == [(0, 4), (4, 4)] and two[8:] == tok.encode("x").ids


def test_config_presets_and_registration():
    cfg = neva_config("tiny")
    assert cfg.architectures == ["NevaForCausalLM"] and cfg.model_type == "neva"
    assert cfg.image_seq_length == 9 and cfg.mm_cfg["vision_encoder"]["class_token_length"] == 0
    real = neva_config("neva-8b-siglip384")
    assert (real.hidden_size, real.num_layers, real.num_attention_heads, real.ffn_hidden_size) == (
        4096,
        32,
        32,
        16384,
    )
    assert real.vocab_size == 256000 and real.image_seq_length == 729
    assert (real.normalization, real.activation, real.rotary_percentage) == (
        "layernorm1p",
        "squared-relu",
        0.5,
    )
    swiglu = neva_config("tiny-swiglu")
    assert swiglu.mm_cfg["vision_encoder"]["class_token_length"] == 1
    assert swiglu.image_seq_length == 4 and swiglu.num_query_groups is None
    assert checkpoint_writers()["neva"] is make_neva_checkpoint
    names = [n for n, _, _ in neva_weight_specs(neva_sizes("tiny"))]
    assert (
        "model.embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector.2.bias"
        in names
    )


@pytest.mark.parametrize("preset", ["tiny", "tiny-swiglu"])
def test_reference_runs_deterministically_with_and_without_an_image(ckpts, preset):
    d = str(ckpts[preset])
    image = make_test_image(3)
    prompt = chat_prompt("What is in this image?")
    ids, new, lp = reference_greedy(d, prompt, [image], 4)
    n = tokens_per_image(neva_sizes(preset))
    assert ids.count(neva_token_ids(407)["placeholder"]) == n
    assert len(new) == 4 and lp.shape == (4, 416) and lp.dtype == torch.float32
    assert torch.isinf(lp[:, 2]).all() and torch.isfinite(lp[:, 3:]).all()
    assert new == lp.argmax(-1).tolist()
    load_reference.cache_clear()
    again = reference_greedy(d, prompt, [image], 4)
    assert again[0] == ids and again[1] == new and torch.equal(again[2], lp)
    text_ids, text_new, text_lp = reference_greedy(d, chat_prompt("Hi", images=0), None, 3)
    assert len(text_new) == 3 and not torch.allclose(text_lp[0], lp[0])
    other = reference_greedy(d, prompt, [make_test_image(4)], 1)[2]
    assert not torch.allclose(other[0], lp[0])  # the image matters
    with pytest.raises(ValueError, match="1 <image> markers for 0 images"):
        reference_greedy(d, prompt, None, 1)


def _grouped_qkv(fused: torch.Tensor, heads: int, groups: int, hd: int):
    per, stride = heads // groups, (heads // groups + 2) * hd
    q, k, v = [], [], []
    for g in range(groups):
        base = g * stride
        q.append(fused[base : base + per * hd])
        k.append(fused[base + per * hd : base + (per + 1) * hd])
        v.append(fused[base + (per + 1) * hd : base + stride])
    return torch.cat(q), torch.cat(k), torch.cat(v)


def _hf_decoder(ref: NevaReference, preset: str) -> torch.nn.Module:
    s = neva_sizes(preset)
    groups, hd = s.query_groups or s.heads, s.hidden // s.heads
    common = dict(
        vocab_size=416,
        hidden_size=s.hidden,
        intermediate_size=s.ffn,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=groups,
        head_dim=hd,
        max_position_embeddings=s.max_position,
        tie_word_embeddings=False,
    )
    rope = {"rope_type": "default", "rope_theta": s.rotary_base}
    if preset == "tiny":
        rope["partial_rotary_factor"] = s.rotary_percentage
        model = NemotronForCausalLM(
            NemotronConfig(
                **common, hidden_act="relu2", norm_eps=s.layernorm_epsilon, rope_parameters=rope
            )
        )
    else:
        model = LlamaForCausalLM(
            LlamaConfig(
                **common, hidden_act="silu", rms_norm_eps=s.layernorm_epsilon, rope_parameters=rope
            )
        )
    w, sd = ref.w, {}
    sd["model.embed_tokens.weight"] = w["model.embedding.word_embeddings.weight"]
    sd["lm_head.weight"] = w["model.output_layer.weight"]
    for leaf in ("weight", "bias"):
        if f"model.decoder.final_layernorm.{leaf}" in w:
            sd[f"model.norm.{leaf}"] = w[f"model.decoder.final_layernorm.{leaf}"]
    for i in range(s.layers):
        m, h = f"model.decoder.layers.{i}.", f"model.layers.{i}."
        q, k, v = _grouped_qkv(w[m + "self_attention.linear_qkv.weight"], s.heads, groups, hd)
        sd.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k})
        sd[h + "self_attn.v_proj.weight"] = v
        sd[h + "self_attn.o_proj.weight"] = w[m + "self_attention.linear_proj.weight"]
        for leaf in ("weight", "bias"):
            for ours, theirs in (
                ("self_attention.linear_qkv", "input"),
                ("mlp.linear_fc1", "post_attention"),
            ):
                if f"{m}{ours}.layer_norm_{leaf}" in w:
                    sd[f"{h}{theirs}_layernorm.{leaf}"] = w[f"{m}{ours}.layer_norm_{leaf}"]
        fc1 = w[m + "mlp.linear_fc1.weight"]
        if preset == "tiny":
            sd[h + "mlp.up_proj.weight"] = fc1
        else:
            sd[h + "mlp.gate_proj.weight"] = fc1[: s.ffn]  # MCore GLU: [gate; up]
            sd[h + "mlp.up_proj.weight"] = fc1[s.ffn :]
        sd[h + "mlp.down_proj.weight"] = w[m + "mlp.linear_fc2.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("preset", ["tiny", "tiny-swiglu"])
def test_reference_decoder_equals_transformers(ckpts, preset):
    """layernorm1p (weight + 1), partial rotary (first half of each head), per-group qkv and GQA (tiny, vs
    Nemotron) and rmsnorm + swiglu + full rotary (tiny-swiglu, vs Llama)."""
    ref = load_reference(str(ckpts[preset]))
    ids = prompt_ids(ref.tokenizer, chat_prompt("Count: one, two, three.", images=0), 1)[0]
    with torch.no_grad():
        expected = _hf_decoder(ref, preset)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ref.logits(ids), expected, atol=2e-4, rtol=1e-4)


def test_rotary_percentage_and_layernorm1p_matter(ckpts, tmp_path):
    ref = load_reference(str(ckpts["tiny"]))
    ids = prompt_ids(ref.tokenizer, chat_prompt("Hello, world!", images=0), 1)[0]
    base = ref.logits(ids)
    full = make_neva_checkpoint(
        tmp_path / "full", preset="tiny", seed=0, rotary_percentage=1.0, progress=False
    )
    assert not torch.allclose(NevaReference(str(full)).logits(ids), base, atol=1e-3)
    assert read_nemo_config(ckpts["tiny"])["normalization"] == "layernorm1p"
    norm = ref.norms["model.decoder.final_layernorm."]
    x = torch.randn(3, 64)
    w, b = (
        ref.w["model.decoder.final_layernorm.weight"],
        ref.w["model.decoder.final_layernorm.bias"],
    )
    assert w.abs().mean() < 0.5  # stored around zero
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (64,), w + 1, b, 1e-5))


def test_the_family_reads_the_nemo_and_the_roofline_counts_its_decoder(tmp_path):
    """mmserve's NeVA config from the .nemo alone; the bench's weight-read roofline equals the decoder's
    parameters but its embedding table (tied here: counted once more as the head)."""
    from mmserve.bench.roofline import lm_shape
    from mmserve.config import ModelConfig
    from mmserve.models.loader import load_hf_config, load_model

    model_dir = make_neva_checkpoint(tmp_path / "n", preset="tiny-swiglu")
    config = load_hf_config(str(model_dir))
    assert config.architectures == ["NevaForCausalLM"] and config.image_token_len == 4
    model = load_model(
        ModelConfig(model=str(model_dir), dtype="float32"), torch.device("cpu")
    ).model
    lm = model.language_model
    decoder = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n)
    head = (
        0
        if any(n.startswith("lm_head") for n, _ in lm.named_parameters())
        else lm.lm_head.weight.numel()
    )
    assert lm_shape(str(model_dir), "float32").weight_bytes == 4 * (decoder + head)
