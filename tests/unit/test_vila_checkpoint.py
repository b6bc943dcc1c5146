"""VILA checkpoints in the published layout: the writer's files, the family's config reader and its errors, the
2×2 downsample's order against VILA's own `flat_square`, tokens per picture and the prompt's ids."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmserve.models.loader import load_hf_config
from mmserve.models.registry import family_for_config, get_model_class
from mmserve.models.vila import PLACEHOLDER_ID, VilaProjector, downsample_2x2, tokens_per_image
from mmserve.testing.vila import make_vila_checkpoint, vila_config
from tests.parity.vila_reference import DownSampleBlock, tokenizer_image_token


@pytest.fixture(scope="module")
def vila_dir(tmp_path_factory):
    return make_vila_checkpoint(tmp_path_factory.mktemp("vila_ckpt"))


def test_published_layout(vila_dir):
    top = json.loads((vila_dir / "config.json").read_text())
    assert top["architectures"] == ["LlavaLlamaModel"] and top["model_type"] == "llava_llama"
    assert {"llm_cfg", "vision_tower_cfg", "mm_projector_cfg"} <= set(top)
    assert (vila_dir / "llm" / "tokenizer.json").is_file()
    assert (vila_dir / "vision_tower" / "preprocessor_config.json").is_file()
    names = set()
    from safetensors import safe_open

    for part in ("llm", "vision_tower", "mm_projector"):
        with safe_open(str(vila_dir / part / "model.safetensors"), "pt") as f:
            names |= {f"{part}/{k}" for k in f.keys()}
    assert "mm_projector/layers.1.weight" in names and "mm_projector/layers.4.bias" in names
    assert (
        "vision_tower/vision_model.head.probe" in names
    )  # the pooling head is saved, and not used
    assert "llm/lm_head.weight" in names and "llm/model.embed_tokens.weight" in names


def test_same_seed_same_bytes(vila_dir, tmp_path):
    again = make_vila_checkpoint(tmp_path / "again")
    for part in ("llm", "vision_tower", "mm_projector"):
        a = (vila_dir / part / "model.safetensors").read_bytes()
        assert a == (again / part / "model.safetensors").read_bytes()


def test_config_reader_and_family(vila_dir):
    config = load_hf_config(str(vila_dir))
    assert family_for_config(config).name == "vila"
    assert config.text_config.model_type == "llama" and config.vision_config.image_size == 42
    assert config.mm_projector_type == "mlp_downsample"
    assert tokens_per_image(config) == 4  # a 3×3 grid padded to 4×4, halved per side
    assert family_for_config(vila_config("tiny")).name == "vila"
    assert tokens_per_image(vila_config("vila1.5-3b")) == 196  # 27×27 → 14×14, the seeds' 196


def test_missing_part_is_named(vila_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(vila_dir, broken)
    shutil.rmtree(broken / "mm_projector")
    with pytest.raises(ValueError, match="no mm_projector/config.json"):
        load_hf_config(str(broken))


def test_unsupported_projector_is_named():
    with pytest.raises(ValueError, match="mm_projector_type 'mlp3x' is not supported"):
        VilaProjector("mlp3x", 8, 8)


@pytest.mark.parametrize("side", [3, 4, 27])
def test_downsample_follows_vilas_flat_square(side):
    x = torch.randn(2, side * side, 5)
    torch.testing.assert_close(downsample_2x2(x), DownSampleBlock()(x), rtol=0, atol=0)


def test_prompt_ids_tokenize_each_chunk_as_vila_does(vila_dir):
    config = load_hf_config(str(vila_dir))
    processor = get_model_class(config).build_processor(str(vila_dir), config)
    text = "USER: <image>\nfirst <image> second ASSISTANT:"
    ids, spans = processor.prompt_ids(text, 2)
    vila = tokenizer_image_token(text, processor.tokenizer)
    expanded = [t for tok in vila for t in ([PLACEHOLDER_ID] * 4 if tok == -200 else [tok])]
    assert ids == expanded and [ids[o : o + n] for o, n in spans] == [[PLACEHOLDER_ID] * 4] * 2
    assert ids.count(processor.tokenizer.bos_token_id) == 1
    with pytest.raises(ValueError, match="2 <image> placeholder"):
        processor.prompt_ids(text, 1)


def test_roofline_reads_the_llm_part(vila_dir):
    """The bench's weight-read roofline counts VILA's Llama (`llm_cfg`) as transformers builds it: its matrices,
    norms and lm_head, not its embedding table."""
    from transformers import AutoConfig, LlamaForCausalLM

    from mmserve.bench.roofline import lm_shape

    with torch.device("meta"):
        llm = LlamaForCausalLM(AutoConfig.from_pretrained(vila_dir / "llm"))
    expected = 4 * sum(p.numel() for n, p in llm.named_parameters() if "embed_tokens" not in n)
    assert lm_shape(str(vila_dir), "float32").weight_bytes == expected
