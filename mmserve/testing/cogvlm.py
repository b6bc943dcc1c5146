"""Random CogVLM (THUDM/cogvlm-chat-hf, "v1") and CogVLM2 (THUDM/cogvlm2-llama3-chat-19B, "v2") checkpoints in their
published on-disk layouts, written offline; the prompt rule that the engine and the eager reference
(``tests/parity/cogvlm_reference.py``) share.

Presets: "tiny" (v1) and "tiny-v2" (v2) for CPU tests, float32; "cogvlm-chat-17b" and "cogvlm2-19b" (real shapes,
random bfloat16) for benchmarks. Both versions name ``CogVLMForCausalLM`` in ``architectures``; :func:`cogvlm_version`
tells them apart (see there). Tensor names, shapes and the config layout: :mod:`mmserve.testing.cogvlm_layout`.

On disk: ``config.json`` as the remote ``configuration_cogvlm.CogVLMConfig`` writes it (``auto_map`` to the remote
modules, never run; no ``model_type``: the remote class has none), ``generation_config.json``, the weights in
safetensors shards + ``model.safetensors.index.json`` (at least two shards unless ``max_shard_bytes`` says
otherwise, as the published repos are sharded) with every name of the published index, ``rotary_emb.inv_freq``
buffers included (their true values, in the checkpoint's dtype: the published v2 index's total_size counts
them as bfloat16). The tokenizer: v1 ships none (its users clone lmsys/vicuna-7b-v1.5's
beside it), so the small BPE goes into a ``tokenizer/`` sub-folder (or ``tokenizer_path``); v2 ships a Llama-3
tokenizer in its root, and so does this writer. :func:`tokenizer_dir` finds either.

Special ids (tiny and real-shape presets alike; the real-shape ones pad the BPE with fillers to ``text_vocab``):
v1 (vicuna layout) unk 0, bos 1, eos 2, pad = unk 0; v2 bos ``<|begin_of_text|>`` 1, eos ``<|end_of_text|>`` 2,
pad ``<|reserved_special_token_0|>`` = text_vocab and ``<|eot_id|>`` = text_vocab + 1, EOS ids [2, text_vocab + 1]
(the real Llama-3 ids are 128000, 128001, 128002 and 128009; the original v2 code hard-codes pad 128002).

The prompt (the original ``CogVLMForCausalLM.build_conversation_input_ids`` with template "chat", the text taken
as given: :func:`chat_prompt` formats a question): ``[bos] + [pad] * N + text_ids`` (text without special tokens),
token types ``[L] + [V] * N + [L] * len(text_ids)``; N = :func:`image_rows` = boi + patches + eoi; at most one
image, always right after BOS; a text-only prompt is ``[bos] + text_ids``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mmserve.testing.cases import FamilyCase
from mmserve.testing.cogvlm_layout import (
    ROPE_BASE,
    config_dict,
    generation_dict,
    inv_freq,
    param_specs,
)
from mmserve.testing.recipe import check_divides, check_roles, layer_maker, replace_sizes
from mmserve.testing.tokenizer import build_bpe_tokenizer
from mmserve.testing.writer import DEFAULT_MAX_SHARD_BYTES, write_sharded_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

LANGUAGE_TOKEN_TYPE, VISION_TOKEN_TYPE = 0, 1  # the original's token_type_ids values
V2_BOS, V2_EOS, V2_PAD, V2_EOT = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|eot_id|>",
)
V2_VOCAB = 128256  # the published v2 vocab (Llama 3), whose config.json omits num_multi_query_heads
V2_DEFAULT_KV_HEADS = 8  # the remote v2 CogVLMConfig's default num_multi_query_heads
TOKENIZER_SUBDIR = "tokenizer"  # v1: where the writer puts the (vicuna-like) tokenizer


@dataclass(frozen=True)
class CogVLMSizes:
    """Every size a preset fixes; any field can be overridden by keyword."""

    version: int  # 1: CogVLM (MHA, grid**2 image rows); 2: CogVLM2 (GQA, vision qkv bias, 2x2 conv)
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int  # v2's num_multi_query_heads; v1: = text_heads
    text_intermediate: int  # both experts' SwiGLU MLPs and the projector GLU
    text_vocab: int  # base BPE vocab of the tokenizer; v2's pad and <|eot_id|> follow it
    vocab_size: int  # model vocab (embed_tokens / lm_head rows), >= the tokenizer
    max_position: int
    rms_norm_eps: float
    vision_hidden: int  # EVA2-CLIP tower
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int
    patch_size: int
    text_init_std: float  # text matrices and embeddings, lm_head
    vision_init_std: float  # tower, projector, conv, boi / eoi
    bias_std: float  # every bias (EVA linears, patch / 2x2 conv, v2 vision qkv)
    norm_std: float  # norm scales are 1 + N(0, norm_std), LayerNorm shifts N(0, norm_std)
    dtype: str
    vision_layer_norm_eps: float = 1e-6


_TINY = dict(
    text_hidden=64,
    text_layers=2,
    text_heads=4,
    text_intermediate=128,
    text_vocab=384,
    vocab_size=392,
    rms_norm_eps=1e-5,
    vision_hidden=32,
    vision_layers=2,
    vision_heads=2,
    vision_intermediate=64,
    patch_size=14,
    text_init_std=0.2,
    vision_init_std=0.2,
    bias_std=0.1,
    norm_std=0.1,
    dtype="float32",
)
_REAL = dict(
    text_hidden=4096,
    text_layers=32,
    text_heads=32,
    vision_hidden=1792,
    vision_layers=63,
    vision_heads=16,
    vision_intermediate=15360,
    patch_size=14,
    text_init_std=0.02,
    vision_init_std=0.02,
    bias_std=0.02,
    norm_std=0.02,
    dtype="bfloat16",
)
PRESETS: dict[str, CogVLMSizes] = {
    # 28 px / 14 -> 2x2 = 4 patches -> 6 image rows
    "tiny": CogVLMSizes(version=1, text_kv_heads=4, max_position=2048, image_size=28, **_TINY),
    # 56 px / 14 -> 4x4 -> 2x2 conv -> 2x2 = 4 -> 6 image rows
    "tiny-v2": CogVLMSizes(version=2, text_kv_heads=2, max_position=8192, image_size=56, **_TINY),
    # Vicuna-7B + EVA2-CLIP-E at 490 px: 35x35 = 1225 patches -> 1227 rows
    "cogvlm-chat-17b": CogVLMSizes(
        version=1,
        text_kv_heads=32,
        text_intermediate=11008,
        text_vocab=32000,
        vocab_size=32000,
        max_position=2048,
        rms_norm_eps=1e-5,
        image_size=490,
        **_REAL,
    ),
    # Llama-3-8B + EVA2-CLIP-E at 1344 px: 96x96 -> conv -> 48x48 = 2304 -> 2306 rows
    "cogvlm2-19b": CogVLMSizes(
        version=2,
        text_kv_heads=8,
        text_intermediate=14336,
        text_vocab=128000,
        vocab_size=V2_VOCAB,
        max_position=8192,
        rms_norm_eps=1e-5,
        image_size=1344,
        **_REAL,
    ),
}


def cogvlm_sizes(preset: str = "tiny", **overrides: object) -> CogVLMSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`CogVLMSizes`) applied, checked."""
    s = replace_sizes(PRESETS, preset, "cogvlm", overrides)
    if s.version not in (1, 2):
        raise ValueError(f"version must be 1 or 2, got {s.version}")
    check_divides(
        s,
        ("text_heads", "text_hidden"),
        ("text_kv_heads", "text_heads"),
        ("vision_heads", "vision_hidden"),
        ("patch_size", "image_size"),
    )
    if s.version == 1 and s.text_kv_heads != s.text_heads:
        raise ValueError("CogVLM (version 1) has no GQA: text_kv_heads must equal text_heads")
    if s.version == 2 and (s.image_size // s.patch_size) % 2:
        raise ValueError("CogVLM2's 2x2 stride-2 conv needs an even patch grid")
    if s.vocab_size < s.text_vocab + (2 if s.version == 2 else 0):
        raise ValueError(f"vocab_size {s.vocab_size} is smaller than the tokenizer")
    return s


def token_ids(s: CogVLMSizes) -> dict[str, Any]:
    """The special ids of the tokenizer the writer builds: bos, eos (every EOS id, a list), pad (the image
    rows' placeholder id)."""
    if s.version == 1:
        return {"bos": 1, "eos": [2], "pad": 0}
    return {"bos": 1, "eos": [2, s.text_vocab + 1], "pad": s.text_vocab}


def build_cogvlm_tokenizer(s: CogVLMSizes) -> PreTrainedTokenizerFast:
    """The small BPE (Llama-style BOS) in the vicuna layout (v1: pad = ``<unk>``) or with Llama 3's names (v2:
    ``<|reserved_special_token_0|>`` as pad and ``<|eot_id|>`` right after the base vocab); no chat template."""
    if s.version == 1:
        tok = build_bpe_tokenizer([], vocab_size=s.text_vocab, pad="<unk>")
        check_roles(
            tok, {"<unk>": 0, "<s>": 1, "</s>": 2}, s.vocab_size, bos="<s>", eos="</s>", pad="<unk>"
        )
        return tok
    tok = build_bpe_tokenizer(
        [V2_PAD, V2_EOT], vocab_size=s.text_vocab, bos=V2_BOS, eos=V2_EOS, pad=V2_PAD
    )
    ids = {V2_BOS: 1, V2_EOS: 2, V2_PAD: s.text_vocab, V2_EOT: s.text_vocab + 1}
    check_roles(tok, ids, s.vocab_size, bos=V2_BOS, eos=V2_EOS, pad=V2_PAD, eot=V2_EOT)
    return tok


def _config_from_sizes(s: CogVLMSizes) -> PretrainedConfig:
    from transformers import PretrainedConfig

    fields = dict(config_dict(s, token_ids(s)))
    fields["dtype"] = fields.pop(
        "torch_dtype"
    )  # transformers 5's name; config.json keeps torch_dtype
    return PretrainedConfig(**fields)


def cogvlm_config(preset: str = "tiny", **overrides: object) -> PretrainedConfig:
    """The config that :func:`make_cogvlm_checkpoint` writes for this preset (a plain ``PretrainedConfig``: no
    transformers class exists; ``architectures == ["CogVLMForCausalLM"]``), no weights built."""
    return _config_from_sizes(cogvlm_sizes(preset, **overrides))


def cogvlm2_config(preset: str = "tiny-v2", **overrides: object) -> PretrainedConfig:
    """:func:`cogvlm_config` with a CogVLM2 preset by default."""
    return cogvlm_config(preset, **overrides)


def load_cogvlm_config(model_dir: str | Path) -> PretrainedConfig:
    """A checkpoint's config.json as a plain ``PretrainedConfig`` (no remote code run)."""
    from transformers import PretrainedConfig

    fields = json.loads((Path(model_dir) / "config.json").read_text())
    if "torch_dtype" in fields:
        fields["dtype"] = fields.pop("torch_dtype")
    return PretrainedConfig(**fields)


def _field(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def cogvlm_version(config: Any) -> int:
    """2 for a CogVLM2 config, else 1 (a config object or the config.json dict).

    The field to use is ``num_multi_query_heads`` (the remote v2 config class has it, v1's has not), but the
    published cogvlm2-llama3-chat-19B config.json leaves it out (its class default, 8, applies): a config without it
    is v2 when its vocab is Llama 3's 128256. (lmdeploy tells them apart by ``hasattr(config,
    'num_multi_query_heads')`` after the remote class filled the default, and the tower by
    ``vision_config['num_positions'] == 1226``, which holds only for the real v1.)"""
    if _field(config, "num_multi_query_heads") is not None:
        return 2
    return 2 if _field(config, "vocab_size") == V2_VOCAB else 1


def kv_heads(config: Any) -> int:
    """Key/value heads of the backbone: v2's ``num_multi_query_heads`` (8 when config.json omits it), v1's
    ``num_attention_heads``."""
    if cogvlm_version(config) == 1:
        return int(_field(config, "num_attention_heads"))
    return int(_field(config, "num_multi_query_heads", V2_DEFAULT_KV_HEADS) or V2_DEFAULT_KV_HEADS)


def rope_base(config: Any) -> float:
    """The rotary base the original hard-codes (not in config.json): 10000 (v1), 500000 (v2)."""
    return ROPE_BASE[cogvlm_version(config)]


def image_rows(config: Any) -> int:
    """Rows one image takes in the prompt: boi + patches + eoi; patches = grid**2 (v1) or (grid / 2)**2 (v2, after
    the 2x2 stride-2 conv), grid = image_size // patch_size of ``vision_config``."""
    vision = _field(config, "vision_config")
    grid = int(_field(vision, "image_size")) // int(_field(vision, "patch_size"))
    if cogvlm_version(config) == 2:
        grid //= 2
    return grid * grid + 2


def chat_prompt(question: str) -> str:
    """The original "chat" template (``_history_to_prompt``, no history): ``"Question: {q} Answer:"``."""
    return f"Question: {question} Answer:"


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase, text: str, num_image_rows: int | None
) -> tuple[list[int], list[int]]:
    """(input ids, token types) of a prompt: ``[bos] + [pad] * num_image_rows + text_ids`` and ``[L] + [V] * rows +
    [L] * len(text_ids)`` (``build_conversation_input_ids``); ``num_image_rows`` None (or 0): no image."""
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    n = num_image_rows or 0
    ids = [tokenizer.bos_token_id] + [tokenizer.pad_token_id] * n + text_ids
    types = [LANGUAGE_TOKEN_TYPE] + [VISION_TOKEN_TYPE] * n + [LANGUAGE_TOKEN_TYPE] * len(text_ids)
    return ids, types


def tokenizer_dir(model_dir: str | Path) -> Path:
    """Where a written checkpoint's tokenizer is: its ``tokenizer/`` sub-folder (v1) when that exists, else the
    checkpoint root (v2)."""
    sub = Path(model_dir) / TOKENIZER_SUBDIR
    return sub if (sub / "tokenizer_config.json").is_file() else Path(model_dir)


def _maker(s: CogVLMSizes, seed: int) -> Any:
    """:func:`~mmserve.testing.recipe.layer_maker`'s tensors; the rotary ``inv_freq`` buffers their true values
    (computed in float32, stored in the checkpoint's dtype)."""
    make = layer_maker(s, _std, seed)
    base, head_dim = ROPE_BASE[s.version], s.text_hidden // s.text_heads

    def make_or_inv_freq(spec: tuple[str, tuple[int, ...], str]) -> torch.Tensor:
        if spec[2] == "inv_freq":
            return inv_freq(head_dim, base).to(getattr(torch, s.dtype))
        return make(spec)

    return make_or_inv_freq


def _std(name: str, s: CogVLMSizes) -> float:
    return s.vision_init_std if name.startswith("model.vision.") else s.text_init_std


def make_cogvlm_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    max_shard_bytes: int | None = None,
    tokenizer_path: str | Path | None = None,
    progress: bool = True,
    **overrides: object,
) -> Path:
    """Write a random CogVLM (``version`` 1) or CogVLM2 (2) checkpoint into ``out_dir`` and return its path.

    ``overrides`` are :class:`CogVLMSizes` fields. Weights: N(0, text_init_std) for the text model's matrices,
    embeddings and lm_head, N(0, vision_init_std) for the tower, projector, conv, cls / position embeddings and
    boi / eoi, N(0, bias_std) for biases, 1 + N(0, norm_std) for norm scales, N(0, norm_std) for LayerNorm shifts;
    seeded per tensor by its name, so the two experts differ and a seed gives byte-identical files.
    ``max_shard_bytes``: None splits the weights into about two shards (with the index); ``tokenizer_path``: v1's
    tokenizer there instead of ``out_dir/tokenizer`` (v2's always goes to the root).
    """
    s = cogvlm_sizes(preset, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        stale.unlink()  # a rebuild with other sizes must not leave old shards behind
    ids = token_ids(s)
    (out / "config.json").write_text(json.dumps(config_dict(s, ids), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(generation_dict(s, ids), indent=2) + "\n"
    )
    tok = build_cogvlm_tokenizer(s)
    if s.version == 1:
        tok.save_pretrained(Path(tokenizer_path) if tokenizer_path else out / TOKENIZER_SUBDIR)
    else:
        tok.save_pretrained(out)
    specs = param_specs(s)
    dtype = getattr(torch, s.dtype)
    if max_shard_bytes is None:
        total = sum(torch.Size(shape).numel() for _, shape, _ in specs) * dtype.itemsize
        max_shard_bytes = min(DEFAULT_MAX_SHARD_BYTES, max(1, total // 2))
    write_sharded_weights(
        out, specs, lambda name: name, dtype, seed, max_shard_bytes, _maker(s, seed), progress
    )
    return out


def make_cogvlm2_checkpoint(out_dir: str | Path, *, preset: str = "tiny-v2", **kw: object) -> Path:
    """:func:`make_cogvlm_checkpoint` with a CogVLM2 preset by default."""
    return make_cogvlm_checkpoint(out_dir, preset=preset, **kw)


CHECKPOINT_WRITERS = {"cogvlm": make_cogvlm_checkpoint, "cogvlm2": make_cogvlm2_checkpoint}
TEST_CASES = {"cogvlm": FamilyCase(bench_input_len=8)}
