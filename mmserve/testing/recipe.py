"""What the family modules of :mod:`mmserve.testing` share besides writing files.

A family's module turns a preset of sizes (:func:`replace_sizes`, :func:`check_divides`) into a transformers
config (:func:`finish_config`; :func:`vit_kwargs` and :func:`decoder_kwargs` for the common towers), checks its
tokenizer's ids (:func:`check_token_ids`, :func:`check_roles`), lists the tensors of a meta-device model
(:func:`meta_tensors`) as the specs that :func:`~mmserve.testing.writer.write_checkpoint` writes, and maps their
names to its on-disk layouts (:func:`renamed`, :func:`checked_name`). Specs are ``(name, shape, kind, std)``
(:func:`param_specs`: norms ones / zeros, biases zeros) or ``(name, shape, kind)`` drawn by :func:`layer_maker`
(biases and norm shifts random too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from mmserve.testing.writer import make_tensor, noisy

if TYPE_CHECKING:
    from transformers import CLIPImageProcessor, PreTrainedConfig, PreTrainedTokenizerBase

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
LAYOUTS = ("hub", "transformers")
# the published (transformers 4) names of a vision-language model's text model and head
HUB_TEXT_NAMES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)

# (name, shape, kind, std): kind is "normal" (N(0, std)), "ones" or "zeros"
ParamSpec = tuple[str, tuple[int, ...], str, float]
# (name, shape, kind): kind is one of :func:`layer_kind`'s
LayerSpec = tuple[str, tuple[int, ...], str]
SizesT = TypeVar("SizesT")
ConfigT = TypeVar("ConfigT", bound="PreTrainedConfig")


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple (padded vocabulary sizes)."""
    return -(-n // multiple) * multiple


def meta_tensors(
    model_cls: type, config: PreTrainedConfig
) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is a norm's parameter) of every tensor in the state dict of ``model_cls(config)``,
    built on the meta device (no memory used)."""
    with torch.device("meta"):
        model = model_cls(config)
    norm_params = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm"):
            norm_params.update(f"{mod_name}.{p}" for p, _ in mod.named_parameters(recurse=False))
    return [(name, tuple(t.shape), name in norm_params) for name, t in model.state_dict().items()]


def param_specs(
    model_cls: type,
    config: PreTrainedConfig,
    std_of: Callable[[str], float],
    random_bias: Callable[[str], bool] = lambda name: False,
) -> list[ParamSpec]:
    """(name, shape, kind, std) of every saved tensor, from :func:`meta_tensors`.

    Norm scales are ones and norm shifts zeros; other biases are zeros unless ``random_bias(name)``;
    the rest is N(0, ``std_of(name)``). A tied ``lm_head.weight`` is not saved.
    """
    tied = getattr(config, "tie_word_embeddings", False)
    specs = []
    for name, shape, is_norm in meta_tensors(model_cls, config):
        if tied and name == "lm_head.weight":
            continue
        if is_norm:
            kind = "zeros" if name.endswith(".bias") else "ones"
        else:
            kind = "zeros" if name.endswith(".bias") and not random_bias(name) else "normal"
        specs.append((name, shape, kind, std_of(name)))
    return specs


def layer_kind(name: str, is_norm: bool, noisy_norm: bool = False) -> str:
    """The kind of a :data:`LayerSpec`: a norm's "norm_bias", or "noisy_norm_weight" when ``noisy_norm`` else
    "norm_weight"; any other tensor's "bias" or "matrix"."""
    if is_norm:
        if name.endswith(".bias"):
            return "norm_bias"
        return "noisy_norm_weight" if noisy_norm else "norm_weight"
    return "bias" if name.endswith(".bias") else "matrix"


def layer_maker(
    s: Any, std_of: Callable[[str, Any], float], seed: int
) -> Callable[[LayerSpec], torch.Tensor]:
    """The tensor maker of :data:`LayerSpec` specs, in the dtype of the sizes ``s``: ones for "norm_weight",
    1 + N(0, ``s.norm_std``) for "noisy_norm_weight", N(0, ``s.norm_std``) for "norm_bias", N(0, ``s.bias_std``)
    for "bias" and N(0, ``std_of(name, s)``) for "matrix"; seeded per tensor by ``seed`` and its name."""
    dtype = getattr(torch, s.dtype)

    def make(spec: LayerSpec) -> torch.Tensor:
        name, shape, kind = spec
        if kind == "norm_weight":
            return torch.ones(shape, dtype=dtype)
        if kind == "noisy_norm_weight":
            return noisy(name, shape, 1.0, s.norm_std, seed, dtype)
        if kind == "norm_bias":
            return make_tensor(name, shape, "normal", s.norm_std, seed, dtype)
        std = s.bias_std if kind == "bias" else std_of(name, s)
        return make_tensor(name, shape, "normal", std, seed, dtype)

    return make


def renamed(name: str, family: str, renames: Sequence[tuple[str, str]]) -> str:
    """``name`` with its prefix replaced by the first (prefix, replacement) of ``renames`` that it starts with;
    a ValueError naming ``family`` when none does."""
    for src, dst in renames:
        if name.startswith(src):
            return dst + name[len(src) :]
    raise ValueError(f"unexpected {family} parameter {name!r}")


def replace_sizes(
    presets: dict[str, SizesT], preset: str, family: str, overrides: dict[str, object]
) -> SizesT:
    """presets[preset] with dataclass-field overrides (lists become tuples); clear errors for unknown names."""
    if preset not in presets:
        raise ValueError(f"unknown {family} preset {preset!r}; known: {sorted(presets)}")
    base = presets[preset]
    fields = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown {family} overrides {unknown}; allowed: {sorted(fields)}")
    overrides = {
        k: tuple(map(tuple, v)) if k == "grid_pinpoints" else tuple(v) if isinstance(v, list) else v
        for k, v in overrides.items()
    }
    return dataclasses.replace(base, **overrides)


def checked_name(name: str, family: str, layout: str, prefixes: Sequence[str]) -> str:
    """``name`` itself in either ``layout``, for families whose ``save_pretrained`` writes the state-dict names;
    a ValueError naming ``family`` unless it starts with one of ``prefixes``."""
    check_layout(layout)
    return renamed(name, family, [(p, p) for p in prefixes])


def check_divides(s: Any, *pairs: tuple[str, str]) -> None:
    """A ValueError unless, for each (divisor, dividend) pair of field names of the sizes ``s``, the first divides
    the second (heads and the widths they split)."""
    for divisor, dividend in pairs:
        d, n = getattr(s, divisor), getattr(s, dividend)
        if n % d:
            raise ValueError(f"{divisor} {d} must divide {dividend} {n}")


def check_layout(layout: str) -> None:
    """Reject a ``layout`` other than "hub" (published repos' names) or "transformers" (save_pretrained's)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'hub' or 'transformers', got {layout!r}")


def check_token_ids(
    tok: PreTrainedTokenizerBase, expected: dict[str, int], tokens: dict[str, str], model_vocab: int
) -> None:
    """Assert the tokenizer's ids equal ``expected`` and fit the model vocab.

    Keys "unk", "bos", "eos", "pad" are read from the tokenizer's special tokens; any other key
    is the id of ``tokens[key]``.
    """
    specials = {
        "unk": tok.unk_token_id,
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
    }
    got = {
        k: specials[k] if k in specials else tok.convert_tokens_to_ids(tokens[k]) for k in expected
    }
    assert got == expected and len(tok) <= model_vocab, (got, expected, len(tok))


def check_roles(
    tok: PreTrainedTokenizerBase, ids: dict[str, int], model_vocab: int, **roles: str
) -> None:
    """:func:`check_token_ids` of ids by token: each role (unk, bos, eos, pad: the tokenizer's; any other name: the
    token given) has the id ``ids`` gives its token."""
    check_token_ids(tok, {role: ids[t] for role, t in roles.items()}, roles, model_vocab)


def finish_config(config: ConfigT, architecture: str, dtype: str) -> ConfigT:
    """Name the model class in ``config`` and set ``dtype`` on it and on each of its sub-configs."""
    config.architectures = [architecture]
    for c in (config, *(getattr(config, key) for key in config.sub_configs)):
        c.dtype = dtype
    return config


def vit_kwargs(s: Any) -> dict[str, Any]:
    """The keywords every ViT config here (CLIP, SigLIP, Pixtral, BLIP-2, Kosmos-2) takes from a sizes'
    ``vision_hidden``, ``vision_intermediate``, ``vision_layers``, ``vision_heads``, ``image_size`` and
    ``patch_size``."""
    return dict(
        hidden_size=s.vision_hidden,
        intermediate_size=s.vision_intermediate,
        num_hidden_layers=s.vision_layers,
        num_attention_heads=s.vision_heads,
        image_size=s.image_size,
        patch_size=s.patch_size,
    )


def decoder_kwargs(
    s: Any, vocab_size: int, bos: int, eos: int | list[int], pad: int, **extra: Any
) -> dict[str, Any]:
    """The keywords of a Llama-style decoder config (Llama, Mistral, Qwen2, Mllama's text model) from a sizes'
    ``text_*`` fields, ``max_position`` and ``rms_norm_eps``, with these special ids and ``extra``."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=s.text_hidden,
        intermediate_size=s.text_intermediate,
        num_hidden_layers=s.text_layers,
        num_attention_heads=s.text_heads,
        num_key_value_heads=s.text_kv_heads,
        max_position_embeddings=s.max_position,
        rms_norm_eps=s.rms_norm_eps,
        initializer_range=s.text_init_std,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        **extra,
    )


def clip_image_processor(image_size: int, center_crop: bool) -> CLIPImageProcessor:
    """A CLIPImageProcessor to ``image_size`` squared, rescaled and CLIP-normalized: its shorter side resized to
    ``image_size`` and center-cropped (llava-1.5), or resized straight to the square (Kosmos-2)."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        size={"shortest_edge": image_size}
        if center_crop
        else {"height": image_size, "width": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_resize=True,
        do_center_crop=center_crop,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )


def special_ids(config: Any, *names: str) -> dict[str, int | None]:
    """`names` (special token ids) as `config` has them, for `write_checkpoint`'s `generation`."""
    return {name: getattr(config, name, None) for name in names}
