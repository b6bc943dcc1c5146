"""Random VILA 1.5 checkpoints in the published layout (`Efficient-Large-Model/VILA1.5-3b`): a top `config.json`
(`LlavaLlamaModel`, model_type `llava_llama`, the parts' configs as `llm_cfg` / `vision_tower_cfg` /
`mm_projector_cfg`) and three sub-folders, each as its part's `save_pretrained` writes it:

- `llm/`: a Llama checkpoint with its tokenizer and generation config;
- `vision_tower/`: a `SiglipVisionModel` (`vision_model.*`, its attention-pooling `head` too) and its
  `preprocessor_config.json` (384 px, bicubic, mean = std = 0.5 for VILA 1.5);
- `mm_projector/`: the `mlp_downsample` projector (`layers.1` LayerNorm, `layers.2` / `layers.4` Linear).

Presets: "tiny" (a 3×3 tower grid, so the 2×2 downsample pads it: 4 tokens a picture) and "vila1.5-3b" (real
shapes, random fp16, for benchmarks). The tokenizer is the small BPE without any `<image>` token: VILA cuts the
prompt at `<image>` (models/vila_processor.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserve.testing.cases import FamilyCase
from mmserve.testing.recipe import (
    check_divides,
    decoder_kwargs,
    finish_config,
    param_specs,
    replace_sizes,
)
from mmserve.testing.tokenizer import build_bpe_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_sharded_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SIGLIP_MEAN_STD = [0.5, 0.5, 0.5]


@dataclass(frozen=True)
class VilaSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    text_vocab: (
        int  # the tokenizer's base ids; the model vocab is this rounded up to vocab_multiple
    )
    vocab_multiple: int
    max_position: int
    text_init_std: float
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int
    patch_size: int
    vision_init_std: float
    select_layer: int
    dtype: str
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    image_aspect_ratio: str = "resize"


PRESETS: dict[str, VilaSizes] = {
    "tiny": VilaSizes(
        text_hidden=64,
        text_layers=2,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=128,
        text_vocab=400,
        vocab_multiple=8,
        max_position=512,
        text_init_std=0.2,
        vision_hidden=32,
        vision_layers=2,
        vision_heads=2,
        vision_intermediate=64,
        image_size=42,
        patch_size=14,
        vision_init_std=0.2,
        select_layer=-2,
        dtype="float32",
    ),
    # VILA1.5-3b: siglip-so400m-patch14-384 and a Sheared-LLaMA-2.7B-shaped decoder
    "vila1.5-3b": VilaSizes(
        text_hidden=2560,
        text_layers=32,
        text_heads=20,
        text_kv_heads=20,
        text_intermediate=6912,
        text_vocab=32000,
        vocab_multiple=1,
        max_position=4096,
        text_init_std=0.02,
        vision_hidden=1152,
        vision_layers=27,
        vision_heads=16,
        vision_intermediate=4304,
        image_size=384,
        patch_size=14,
        vision_init_std=0.02,
        select_layer=-2,
        dtype="float16",
    ),
}


def vila_sizes(preset: str = "tiny", **overrides: object) -> VilaSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`VilaSizes`) applied."""
    return replace_sizes(PRESETS, preset, "vila", overrides)


def _model_vocab(s: VilaSizes) -> int:
    return -(-s.text_vocab // s.vocab_multiple) * s.vocab_multiple


def _llm_config(s: VilaSizes) -> Any:
    from transformers import LlamaConfig

    check_divides(s, ("text_heads", "text_hidden"), ("text_kv_heads", "text_heads"))
    config = LlamaConfig(
        **decoder_kwargs(
            s,
            _model_vocab(s),
            1,
            2,
            0,
            head_dim=s.text_hidden // s.text_heads,
            rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta},
            tie_word_embeddings=False,
        )
    )
    return finish_config(config, "LlamaForCausalLM", s.dtype)


def _vision_config(s: VilaSizes) -> Any:
    from transformers import SiglipVisionConfig

    check_divides(s, ("vision_heads", "vision_hidden"))  # 384 px / 14: SigLIP drops the rest
    config = SiglipVisionConfig(
        hidden_size=s.vision_hidden,
        intermediate_size=s.vision_intermediate,
        num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads,
        image_size=s.image_size,
        patch_size=s.patch_size,
        hidden_act="gelu_pytorch_tanh",
        layer_norm_eps=1e-6,
    )
    return finish_config(config, "SiglipVisionModel", s.dtype)


def _projector_config() -> dict[str, Any]:
    return {
        "architectures": ["MultimodalProjector"],
        "mm_projector_type": "mlp_downsample",
        "model_type": "v2l_projector",
    }


def _top_config(s: VilaSizes, llm: Any, vision: Any) -> dict[str, Any]:
    """The top config.json as VILA's `LlavaLlamaConfig.save_pretrained` writes it."""
    return {
        "architectures": ["LlavaLlamaModel"],
        "model_type": "llava_llama",
        "llm_cfg": {**llm.to_dict(), "_name_or_path": "./llm"},
        "vision_tower_cfg": {**vision.to_dict(), "_name_or_path": "./vision_tower"},
        "mm_projector_cfg": {**_projector_config(), "_name_or_path": "./mm_projector"},
        "hidden_size": s.text_hidden,
        "mm_hidden_size": s.vision_hidden,
        "image_aspect_ratio": s.image_aspect_ratio,
        "mm_vision_select_layer": s.select_layer,
        "mm_vision_select_feature": "cls_patch",
        "mm_use_im_start_end": False,
        "mm_use_im_patch_token": False,
        "model_dtype": f"torch.{s.dtype}",
        "vision_resolution": -1,
        "interpolate_mode": "linear",
        "s2": False,
        "resume_path": None,
        "tune_language_model": True,
        "tune_mm_projector": True,
        "tune_vision_tower": True,
        "transformers_version": "4.36.2",
    }


def vila_config(preset: str = "tiny", **overrides: object) -> PretrainedConfig:
    """The config the VILA family reads for this preset (top fields, `text_config`, `vision_config`)."""
    from transformers import PretrainedConfig

    s = vila_sizes(preset, **overrides)
    llm, vision = _llm_config(s), _vision_config(s)
    top = _top_config(s, llm, vision)
    config = PretrainedConfig(
        **{k: v for k, v in top.items() if not k.endswith("_cfg") and k != "model_type"}
    )
    config.text_config, config.vision_config = llm, vision
    config.mm_projector_type = "mlp_downsample"
    return config


def _projector_specs(s: VilaSizes) -> list[tuple[str, tuple[int, ...], str, float]]:
    width = 4 * s.vision_hidden
    return [
        ("layers.1.weight", (width,), "ones", 0.0),
        ("layers.1.bias", (width,), "zeros", 0.0),
        ("layers.2.weight", (s.text_hidden, width), "normal", s.text_init_std),
        ("layers.2.bias", (s.text_hidden,), "normal", s.text_init_std),
        ("layers.4.weight", (s.text_hidden, s.text_hidden), "normal", s.text_init_std),
        ("layers.4.bias", (s.text_hidden,), "normal", s.text_init_std),
    ]


def make_vila_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    **overrides: object,
) -> Path:
    """Write a complete random VILA 1.5 checkpoint (module docstring) into ``out_dir`` and return its path.

    Weights are seeded per tensor by their name in the part's folder (`llm/`'s Llama, `vision_tower/`'s SigLIP
    with its pooling head, `mm_projector/`): N(0, std) matrices, ones / zeros for norm scales / shifts, random
    biases in the projector; the same seed gives byte-identical files.
    """
    from transformers import (
        GenerationConfig,
        LlamaForCausalLM,
        SiglipImageProcessor,
        SiglipVisionModel,
    )

    s = vila_sizes(preset, **overrides)
    llm, vision = _llm_config(s), _vision_config(s)
    out = Path(out_dir)
    for part in ("llm", "vision_tower", "mm_projector"):
        (out / part).mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_top_config(s, llm, vision), indent=2) + "\n")

    tok = build_bpe_tokenizer([], vocab_size=s.text_vocab, pad="<unk>")  # Llama 2: pad = unk
    assert len(tok) <= llm.vocab_size, (len(tok), llm.vocab_size)
    tok.save_pretrained(out / "llm")
    llm.save_pretrained(out / "llm")
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out / "llm")
    text_std = lambda name: s.text_init_std  # noqa: E731
    write_sharded_weights(
        out / "llm",
        param_specs(LlamaForCausalLM, llm, text_std),
        str,
        s.dtype,
        seed,
        max_shard_bytes,
    )

    vision.save_pretrained(out / "vision_tower")
    SiglipImageProcessor(
        size={"height": s.image_size, "width": s.image_size},
        image_mean=SIGLIP_MEAN_STD,
        image_std=SIGLIP_MEAN_STD,
    ).save_pretrained(out / "vision_tower")
    vision_std = lambda name: s.vision_init_std  # noqa: E731
    specs = param_specs(SiglipVisionModel, vision, vision_std, random_bias=lambda name: True)
    published = lambda n: n if n.startswith("vision_model.") else "vision_model." + n  # noqa: E731
    write_sharded_weights(out / "vision_tower", specs, published, s.dtype, seed, max_shard_bytes)

    (out / "mm_projector" / "config.json").write_text(
        json.dumps(_projector_config(), indent=2) + "\n"
    )
    write_sharded_weights(
        out / "mm_projector", _projector_specs(s), lambda n: n, s.dtype, seed, max_shard_bytes
    )
    return out


PRESETS["tiny-pad"] = dataclasses.replace(PRESETS["tiny"], image_aspect_ratio="pad")
CHECKPOINT_WRITERS = {"vila": make_vila_checkpoint}
TEST_CASES = {"vila": FamilyCase(bench_input_len=8)}
