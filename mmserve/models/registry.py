"""The family registry: which class serves a checkpoint, found by its `config.json`.

A family registers itself from its own file (`@register_family(spec)` on its class, `declare_family(spec)` for a
spec alone); the first lookup imports every module of `models/` once, so a new family needs no line here.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmserve.models.family import FamilySpec, TextShape

_SPECS: dict[str, FamilySpec] = {}
_CLASSES: dict[str, type] = {}
_discovered = False
_TEXT_SHAPES: dict[str, Callable[[dict[str, Any]], TextShape]] = {}


def declare_family(spec: FamilySpec) -> FamilySpec:
    """Register a family's spec alone: a seeds' model type whose prompt and client formats are known but whose
    checkpoints no class of ours loads yet (nothing matches its empty `architectures`)."""
    if spec.name in _SPECS and _SPECS[spec.name] != spec:
        raise ValueError(f"model family {spec.name!r} is declared twice")
    _SPECS[spec.name] = spec
    return spec


def register_family(spec: FamilySpec) -> Callable[[type], type]:
    """Class decorator: `spec` describes this class, which serves the checkpoints `spec` matches."""

    def attach(cls: type) -> type:
        from mmserve.models.base import CrossAttentionLM, EncoderDecoderLM

        needs = {"cross": CrossAttentionLM, "encoder_decoder": EncoderDecoderLM}.get(spec.attention)
        if needs is not None and not issubclass(cls, needs):
            raise TypeError(
                f"{cls.__name__}: attention {spec.attention!r} needs a {needs.__name__}"
            )
        declare_family(spec)
        _CLASSES[spec.name] = cls
        cls.family = spec  # the class's declared contract (MultiModalCausalLM.family)
        return cls

    return attach


def _discover() -> None:
    global _discovered
    if not _discovered:
        import mmserve.models as package

        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
        _discovered = True


def families() -> list[FamilySpec]:
    """Every declared family, by name."""
    _discover()
    return [_SPECS[name] for name in sorted(_SPECS)]


def family_named(name: str) -> FamilySpec:
    _discover()
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(
            f"unknown model family {name!r}; known families: {', '.join(sorted(_SPECS))}"
        ) from None


def family_for_model_type(model_type: str) -> FamilySpec | None:
    """The family whose prompt format answers to `model_type` (an HF config.model_type, a seeds' name or the
    family's own name)."""
    _discover()
    specs = list(_SPECS.values())
    return next((s for s in specs if model_type in s.model_types), None) or _SPECS.get(model_type)


def family_for_config(hf_config: Any) -> FamilySpec:
    """The family serving a checkpoint, by its config; ValueError naming the architecture when none does."""
    _discover()
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        candidates = [s for s in _SPECS.values() if arch in s.architectures]
        chosen = [s for s in candidates if s.config_matches and s.config_matches(hf_config)]
        chosen += [s for s in candidates if s.config_matches is None]
        if chosen:
            return chosen[0]
    supported = sorted({a for s in _SPECS.values() for a in s.architectures})
    raise ValueError(
        f"architecture {archs[0] if archs else '(none given in config.json)'!r} is not supported; "
        f"supported architectures: {', '.join(supported)}"
    )


def class_for_checkpoint(model_dir: str | Path) -> type | None:
    """The class that reads this checkpoint directory's config: by `config.json`'s `architectures` (any family
    serving one; `config_matches` decides later, on the config it reads), else by a family's `checkpoint_file`;
    None when no family claims it."""
    _discover()
    path = Path(model_dir)
    config = path / "config.json"
    if config.is_file():
        try:
            archs = json.loads(config.read_text()).get("architectures") or []
        except (ValueError, AttributeError):
            return None
        for arch in archs:
            for name, cls in _CLASSES.items():
                if arch in _SPECS[name].architectures:
                    return cls
        return None
    for name, cls in _CLASSES.items():
        marker = _SPECS[name].checkpoint_file
        if marker and any(p.is_file() for p in path.glob(marker)):
            return cls
    return None


def get_model_class(hf_config: Any) -> type:
    """Our implementation of the checkpoint's family; ValueError naming its architecture when unsupported."""
    return _CLASSES[family_for_config(hf_config).name]


def supported_architectures() -> list[str]:
    _discover()
    return sorted({a for s in _SPECS.values() for a in s.architectures})


def register_text_shape(
    *model_types: str,
) -> Callable[[Callable[[dict[str, Any]], TextShape]], Callable[[dict[str, Any]], TextShape]]:
    """Decorator: how a text model's module reads its sizes from a config.json's text part, for these
    `model_type`s ("*": every model_type no module claims, the Llama-style default)."""

    def attach(
        read: Callable[[dict[str, Any]], TextShape],
    ) -> Callable[[dict[str, Any]], TextShape]:
        for model_type in model_types:
            _TEXT_SHAPES[model_type] = read
        return read

    return attach


def text_shape(text: dict[str, Any]) -> TextShape:
    """The decode-step sizes of the language model whose config.json part is `text`."""
    _discover()
    read = _TEXT_SHAPES.get(str(text.get("model_type", ""))) or _TEXT_SHAPES["*"]
    return read(text)
