"""Random NeMo NeVA checkpoints (a ``.nemo`` plus its HF vision tower) written offline, without NeMo.

:func:`make_neva_checkpoint` writes ``out_dir/model.nemo``, a tar (gzip with ``compress=True``) of
``./model_config.yaml`` (:func:`nemo_yaml`, as NeMo and TensorRT-LLM's ``build_neva_engine`` read it),
``./model_weights.ckpt`` (``torch.save`` of the flat Megatron-core state dict of :func:`neva_weight_specs` plus
Transformer Engine ``_extra_state`` entries as ``io.BytesIO``) and ``./<hash>_tokenizer.json`` (yaml
``tokenizer.model: nemo:<hash>_tokenizer.json``), and ``out_dir/vision_tower/`` (HF ``SiglipVisionModel`` /
``CLIPVisionModel`` + preprocessor config) named by ``mm_cfg.vision_encoder.from_pretrained`` and found next to the
``.nemo`` as build_neva_engine does. ``linear_qkv`` rows are Megatron's per-group ``[groups, q_per_group + 2,
head_dim, hidden]`` (the group's query heads, its key, its value); norms are fused into ``linear_qkv`` /
``linear_fc1`` as ``layer_norm_weight`` / ``_bias``; GLU ``linear_fc1`` is [gate; up]; layernorm1p scales are
stored minus one.

Tokenizer: real NeVAs carry a SentencePiece ``tokenizer.model`` (``library: sentencepiece``); this is a HF
``tokenizers`` JSON (``library: tokenizers``, not a NeMo value) of the small BPE plus ``<extra_id_0..7>``, ``<pad>``,
with no post-processor (no BOS added, like ``sp.encode``); ``<s>``, ``</s>``, ``<unk>`` are bos, eos (end id), unk.

Prompt convention (engine and reference): :func:`chat_prompt` is the seeds' NeVA template (TensorRT-LLM
``MultimodalModelRunner``: pre ``<extra_id_0>System\\n\\n<extra_id_1>User\\n``, the image's rows, post
``\\n{question}\\n<extra_id_1>Assistant\\n``); :func:`prompt_ids` splits on ``<image>``, tokenizes each part alone
without BOS / EOS (run.py's ``sp.encode``) and puts ``image_token_len`` copies of ``<extra_id_3>`` (NeMo's image
patch token) per image; the model overwrites that whole span with the projected image features.

Presets: "tiny" (NVGPT style: layernorm1p, squared-relu, rotary 0.5, GQA, SigLIP), "tiny-swiglu" (llama_2 style:
rmsnorm, swiglu, full rotary, MHA, CLIP with its CLS dropped), "neva-8b-siglip384" (the seeds' ``neva.nemo`` as far
as known: 729 features = SigLIP so400m patch14-384; decoder of Nemotron-3 8B / NVGPT 8B; bf16).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from transformers import PreTrainedConfig

from mmserve.testing import cases, recipe, writer
from mmserve.testing.tokenizer import build_bpe_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

IMAGE_TOKEN = "<image>"
EXTRA_IDS = tuple(f"<extra_id_{i}>" for i in range(8))
PLACEHOLDER_TOKEN = "<extra_id_3>"
EOS_TOKEN, BOS_TOKEN, PAD_TOKEN = "</s>", "<s>", "<pad>"
PRE_PROMPT = "<extra_id_0>System\n\n<extra_id_1>User\n"
POST_PROMPT = "\n{question}\n<extra_id_1>Assistant\n"
NEMO_NAME = "model.nemo"
VISION_DIR = "vision_tower"
TOKENIZER_LIBRARY = "tokenizers"
GATED = ("swiglu", "fast-swiglu")
PROJECTOR = "model.embedding.word_embeddings.adapter_layer.mm_projector_adapter.mm_projector"


@dataclass(frozen=True)
class NevaSizes:
    """Every size a preset fixes (defaults: "tiny"); any field can be overridden by keyword."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    query_groups: int | None = 2  # None: one per head (MHA)
    kv_channels: int | None = None  # None: hidden // heads
    ffn: int = 128
    # base BPE ids, then <extra_id_0..7> and <pad>: 416 ids, no unreachable rows
    text_vocab: int = 407
    vocab_multiple: int = 16  # make_vocab_size_divisible_by
    max_position: int = 256
    normalization: str = "layernorm1p"  # layernorm1p | layernorm | rmsnorm
    activation: str = "squared-relu"  # squared-relu | gelu | swiglu | fast-swiglu
    rotary_percentage: float = 0.5
    model_type: str = "nvgpt"  # mm_cfg.llm.model_type
    init_std: float = 0.2
    norm_std: float = 0.1
    bias_std: float = 0.1
    bias: bool = False
    layernorm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    share_embeddings: bool = False
    vision_model: str = "siglip"  # siglip | clip
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    vision_intermediate: int = 64
    image_size: int = 42
    patch_size: int = 14
    vision_init_std: float = 0.2
    vision_select_layer: int = -2
    dtype: str = "float32"


PRESETS: dict[str, NevaSizes] = {
    "tiny": NevaSizes(),
    "tiny-swiglu": NevaSizes(
        layers=3,
        query_groups=None,
        normalization="rmsnorm",
        activation="swiglu",
        rotary_percentage=1.0,
        model_type="llama_2",
        vision_model="clip",
        image_size=28,
    ),
    "neva-8b-siglip384": NevaSizes(
        hidden=4096,
        layers=32,
        heads=32,
        query_groups=None,
        ffn=16384,
        text_vocab=256000 - len(EXTRA_IDS) - 1,
        vocab_multiple=128,
        max_position=4096,
        init_std=0.02,
        norm_std=0.02,
        bias_std=0.02,
        vision_hidden=1152,
        vision_layers=27,
        vision_heads=16,
        vision_intermediate=4304,
        image_size=384,
        vision_init_std=0.02,
        dtype="bfloat16",
    ),
}


def neva_sizes(preset: str = "tiny", **overrides: object) -> NevaSizes:
    """The preset's sizes with ``overrides`` (field names of :class:`NevaSizes`) applied."""
    return recipe.replace_sizes(PRESETS, preset, "neva", overrides)


def class_token_length(s: NevaSizes) -> int:
    """Leading tokens of the tower's output that are not patches: CLIP's CLS, none for SigLIP."""
    return 1 if s.vision_model == "clip" else 0


def tokens_per_image(s: NevaSizes) -> int:
    """image_token_len: the patches of one image (the CLS dropped)."""
    return (s.image_size // s.patch_size) ** 2


def vocab_size(s: NevaSizes) -> int:
    """Rows of the word embeddings: the tokenizer's ids padded to ``vocab_multiple``."""
    return recipe.round_up(s.text_vocab + len(EXTRA_IDS) + 1, s.vocab_multiple)


def neva_token_ids(text_vocab: int) -> dict[str, int]:
    """unk, bos, eos = 0, 1, 2; <extra_id_0..7> from ``text_vocab`` on, then pad; placeholder = <extra_id_3>."""
    ids = {"unk": 0, "bos": 1, "eos": 2, "pad": text_vocab + len(EXTRA_IDS)}
    ids.update({t: text_vocab + i for i, t in enumerate(EXTRA_IDS)})
    ids["placeholder"] = ids[PLACEHOLDER_TOKEN]
    return ids


def tokenizer_json(text_vocab: int) -> str:
    """The tokenizer file's text: the small BPE with <extra_id_0..7> and <pad> as special tokens, no
    post-processor (no BOS added)."""
    tok = build_bpe_tokenizer(list(EXTRA_IDS), vocab_size=text_vocab, pad=PAD_TOKEN)
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["post_processor"] = None
    vocab = {**spec["model"]["vocab"], **{t["content"]: t["id"] for t in spec["added_tokens"]}}
    ids = neva_token_ids(text_vocab)
    tokens = {"unk": "<unk>", "bos": BOS_TOKEN, "eos": EOS_TOKEN, "pad": PAD_TOKEN}
    assert all(vocab[tokens.get(k, k)] == i for k, i in ids.items() if k != "placeholder"), ids
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


# model_config.yaml key -> NevaSizes field
_YAML_FIELDS = dict(
    pair.split("=")
    for pair in (
        "max_position_embeddings=max_position num_layers=layers hidden_size=hidden ffn_hidden_size=ffn "
        "num_attention_heads=heads num_query_groups=query_groups kv_channels=kv_channels "
        "init_method_std=init_std normalization=normalization layernorm_epsilon=layernorm_epsilon bias=bias "
        "activation=activation rotary_percentage=rotary_percentage rotary_base=rotary_base "
        "share_embeddings_and_output_weights=share_embeddings make_vocab_size_divisible_by=vocab_multiple"
    ).split()
)


def nemo_yaml(s: NevaSizes, tokenizer_member: str) -> dict[str, Any]:
    """model_config.yaml of a NeVA with these sizes (the keys NeMo and build_neva_engine read)."""
    return {
        "precision": "bf16" if s.dtype == "bfloat16" else 16 if s.dtype == "float16" else 32,
        "mcore_gpt": True,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "encoder_seq_length": s.max_position,
        "position_embedding_type": "rope",
        "transformer_block_type": "pre_ln",
        "seq_len_interpolation_factor": None,
        **{key: getattr(s, field) for key, field in _YAML_FIELDS.items()},
        "mm_cfg": {
            "llm": {"from_pretrained": None, "model_type": s.model_type},
            "vision_encoder": {
                "from_pretrained": VISION_DIR,
                "from_hf": True,
                "patch_dim": s.patch_size,
                "crop_size": [s.image_size, s.image_size],
                "hidden_size": s.vision_hidden,
                "vision_select_layer": s.vision_select_layer,
                "vision_select_feature": "patch",
                "class_token_length": class_token_length(s),
            },
            "mm_mlp_adapter_type": "mlp2x_gelu",
            "use_im_start_end": False,
        },
        "data": {
            "image_token_len": tokens_per_image(s),
            "conv_template": "nvgpt",
            "image_aspect_ratio": "square",
        },
        "tokenizer": {"library": TOKENIZER_LIBRARY, "model": f"nemo:{tokenizer_member}"},
    }


def neva_weight_specs(s: NevaSizes) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of model_weights.ckpt, in Megatron-core's order; kind is "matrix",
    "bias", "norm_weight" or "norm_bias"."""
    h, kv = s.hidden, s.kv_channels or s.hidden // s.heads
    groups = s.query_groups or s.heads
    fc1 = s.ffn * (2 if s.activation in GATED else 1)
    norm = [("weight", (h,), "norm_weight")]
    if s.normalization != "rmsnorm":
        norm.append(("bias", (h,), "norm_bias"))
    specs = [("model.embedding.word_embeddings.weight", (vocab_size(s), h), "matrix")]
    for i in range(s.layers):
        p = f"model.decoder.layers.{i}."
        for module, shape in (
            ("self_attention.linear_qkv", ((s.heads + 2 * groups) * kv, h)),
            ("self_attention.linear_proj", (h, s.heads * kv)),
            ("mlp.linear_fc1", (fc1, h)),
            ("mlp.linear_fc2", (h, s.ffn)),
        ):
            if module.endswith(("qkv", "fc1")):
                specs += [(f"{p}{module}.layer_norm_{leaf}", sh, k) for leaf, sh, k in norm]
            specs.append((f"{p}{module}.weight", shape, "matrix"))
            if s.bias:
                specs.append((f"{p}{module}.bias", shape[:1], "bias"))
    specs += [(f"model.decoder.final_layernorm.{leaf}", sh, k) for leaf, sh, k in norm]
    if not s.share_embeddings:
        specs.append(("model.output_layer.weight", (vocab_size(s), h), "matrix"))
    for i, shape in ((0, (h, s.vision_hidden)), (2, (h, h))):
        p = f"{PROJECTOR}.{i}."
        specs += [(p + "weight", shape, "matrix"), (p + "bias", (h,), "bias")]
    return specs


def make_neva_weights(s: NevaSizes, seed: int) -> dict[str, torch.Tensor]:
    """The tensors of :func:`neva_weight_specs`, seeded per name: N(0, init_std) matrices, N(0, bias_std) biases,
    norm shifts N(0, norm_std), norm scales 1 + N(0, norm_std) (layernorm1p's stored minus one)."""
    dtype = getattr(torch, s.dtype)
    out = {}
    for name, shape, kind in neva_weight_specs(s):
        if kind == "norm_weight" and s.normalization != "layernorm1p":
            out[name] = writer.noisy(name, shape, 1.0, s.norm_std, seed, dtype)
        else:
            std = {"matrix": s.init_std, "bias": s.bias_std}.get(kind, s.norm_std)
            out[name] = writer.make_tensor(name, shape, "normal", std, seed, dtype)
    return out


def _extra_states(s: NevaSizes) -> dict[str, io.BytesIO]:
    names = ("linear_qkv", "linear_proj", "core_attention", "linear_fc1", "linear_fc2")
    return {
        f"model.decoder.layers.{i}.{'mlp' if 'fc' in m else 'self_attention'}.{m}._extra_state": io.BytesIO()
        for i in range(s.layers)
        for m in names
    }


def write_vision_tower(out: Path, s: NevaSizes, seed: int, progress: bool = True) -> Path:
    """The HF tower folder: config, preprocessor (bicubic to the square, SigLIP's or CLIP's mean / std), weights."""
    import transformers as tf

    name = "SiglipVision" if s.vision_model == "siglip" else "CLIPVision"
    cfg = getattr(tf, f"{name}Config")(**recipe.vit_kwargs(s))
    cfg.architectures, cfg.dtype = [f"{name}Model"], s.dtype
    cfg.save_pretrained(out)  # creates out
    if s.vision_model == "siglip":
        tf.SiglipImageProcessor(
            size={"height": s.image_size, "width": s.image_size}
        ).save_pretrained(out)
    else:
        recipe.clip_image_processor(s.image_size, center_crop=False).save_pretrained(out)
    meta = recipe.meta_tensors(getattr(tf, f"{name}Model"), cfg)
    specs = [(n, sh, recipe.layer_kind(n, is_norm, True)) for n, sh, is_norm in meta]
    make = recipe.layer_maker(s, lambda name, s: s.vision_init_std, seed)
    writer.write_sharded_weights(
        out, specs, lambda n: n, s.dtype, seed, writer.DEFAULT_MAX_SHARD_BYTES, make, progress
    )
    return out


def _add(tar: tarfile.TarFile, arcname: str, path: Path | None = None, data: bytes = b"") -> None:
    info = tarfile.TarInfo(arcname)
    info.size = path.stat().st_size if path is not None else len(data)
    info.mode, info.mtime = 0o644, 0
    with open(path, "rb") if path is not None else io.BytesIO(data) as f:
        tar.addfile(info, f)


def make_neva_checkpoint(
    out_dir: str | Path,
    *,
    preset: str = "tiny",
    seed: int = 0,
    compress: bool = False,
    progress: bool = True,
    **overrides: object,
) -> Path:
    """Write ``out_dir/model.nemo`` (gzip with ``compress``) and ``out_dir/vision_tower/``; return ``out_dir``.
    ``overrides``: :class:`NevaSizes` fields. A seed gives identical tensors; the state dict is built in memory
    (the 8B preset: ~17 GB of RAM, and twice the .nemo's size of disk while the tar is written)."""
    s = neva_sizes(preset, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_json(s.text_vocab).encode()
    member = f"{hashlib.sha256(tok).hexdigest()[:32]}_tokenizer.json"
    cfg = yaml.safe_dump(nemo_yaml(s, member), sort_keys=False).encode()
    state: dict[str, Any] = make_neva_weights(s, seed)
    state.update(_extra_states(s))
    tmp = out / f".{NEMO_NAME}.weights.tmp"
    try:
        torch.save(state, tmp)
        del state
        with tarfile.open(out / f".{NEMO_NAME}.tmp", "w:gz" if compress else "w") as tar:
            _add(tar, "./model_config.yaml", data=cfg)
            _add(tar, "./model_weights.ckpt", path=tmp)
            _add(tar, f"./{member}", data=tok)
        os.replace(out / f".{NEMO_NAME}.tmp", out / NEMO_NAME)
    finally:
        tmp.unlink(missing_ok=True)
    write_vision_tower(out / VISION_DIR, s, seed, progress)
    return out


class NevaConfig(PreTrainedConfig):
    """The yaml's keys as a transformers config (a ``.nemo`` has no HF config; "NevaForCausalLM" is a name of
    ours) plus vocab_size, the special ids, image_token_id (the placeholder) and image_seq_length."""

    model_type = "neva"


def neva_config(preset: str = "tiny", **overrides: object) -> NevaConfig:
    """The :class:`NevaConfig` of what :func:`make_neva_checkpoint` writes for this preset (no weights built)."""
    s = neva_sizes(preset, **overrides)
    ids = neva_token_ids(s.text_vocab)
    cfg = NevaConfig(
        **nemo_yaml(s, "<hash>_tokenizer.json"),
        vocab_size=vocab_size(s),
        **{f"{k}_token_id": ids[k] for k in ("bos", "eos", "pad")},
        image_token_id=ids["placeholder"],
        image_seq_length=tokens_per_image(s),
        tie_word_embeddings=s.share_embeddings,
    )
    cfg.architectures = ["NevaForCausalLM"]
    cfg.dtype = s.dtype
    return cfg


def chat_prompt(question: str, images: int = 1) -> str:
    """The seeds' NeVA prompt (TRT-LLM MultimodalModelRunner): ``images`` ``<image>`` markers between its pre and
    post prompt; with none, NeMo's nvgpt turn (``{question}`` right after the pre prompt)."""
    if images == 0:
        return f"{PRE_PROMPT}{question}\n<extra_id_1>Assistant\n"
    return PRE_PROMPT + IMAGE_TOKEN * images + POST_PROMPT.format(question=question)


def prompt_ids(
    tokenizer: Tokenizer | Any, text: str, tokens_per_image: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, spans) of ``text``: each ``<image>`` becomes ``tokens_per_image`` <extra_id_3> ids, the parts between
    are tokenized alone without special tokens (no BOS); spans are (start, length) of each image's placeholders.
    ``tokenizer``: a ``tokenizers.Tokenizer`` (the .nemo's file) or a transformers fast tokenizer over one."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    placeholder = backend.token_to_id(PLACEHOLDER_TOKEN)
    if placeholder is None:
        raise ValueError(f"the tokenizer has no {PLACEHOLDER_TOKEN} token")
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for i, part in enumerate(text.split(IMAGE_TOKEN)):
        if i:
            spans.append((len(ids), tokens_per_image))
            ids += [placeholder] * tokens_per_image
        if part:
            ids += backend.encode(part, add_special_tokens=False).ids
    return ids, spans


CHECKPOINT_WRITERS = {"neva": make_neva_checkpoint}
TEST_CASES = {"neva": cases.FamilyCase(bench_input_len=8)}
