"""mmserve.testing finds its checkpoint writers in its own modules (each module's CHECKPOINT_WRITERS), and every
registered model family with a checkpoint format has one: its own, or a preset of another family's writer."""

from __future__ import annotations

import importlib

import pytest

import mmserve.testing as testing
from mmserve.models import registry

# families written by a preset of another family's writer: family -> (writer's family, preset)
WRITTEN_AS_PRESET = {"blip2_t5": ("blip2", "tiny-t5"), "qwen2_5_vl": ("qwen2_vl", "tiny-2.5")}
# the keys that the bench (`--family`), `mmserve demo-model --family` and the tests name
KNOWN = (
    "blip2 cogvlm cogvlm2 fuyu internlm_xcomposer2 kosmos2 llava llava_next llava_onevision mllama "
    "neva nougat pix2struct pixtral qwen2_vl vila"
).split()


def test_families_are_the_testing_modules_checkpoint_writers():
    assert sorted(testing.FAMILIES) == sorted(testing.checkpoint_writers()) == KNOWN
    assert (
        next(iter(testing.FAMILIES)) == "llava"
    )  # the demo model's, `mmserve demo-model`'s default
    for family, path in testing.FAMILIES.items():
        module_name, name = path.split(":")
        module = importlib.import_module(module_name)
        assert module.CHECKPOINT_WRITERS[family] is getattr(module, name)
        assert testing.checkpoint_writers()[family] is getattr(module, name)
    with pytest.raises(
        ValueError, match="unknown model family 'nope'; known families: blip2, cogvlm"
    ):
        testing.make_checkpoint("nope", "/nonexistent")


def test_a_family_with_two_writers_is_an_error(monkeypatch):
    from mmserve.testing import fuyu

    monkeypatch.setattr(testing, "_WRITERS", {})
    monkeypatch.setattr(
        fuyu, "CHECKPOINT_WRITERS", {**fuyu.CHECKPOINT_WRITERS, "llava": fuyu.make_fuyu_checkpoint}
    )
    with pytest.raises(ValueError, match="'llava' has two checkpoint writers"):
        testing.checkpoint_writers()


@pytest.mark.parametrize(
    "spec", [s for s in registry.families() if s.architectures], ids=lambda s: s.name
)
def test_every_family_with_a_checkpoint_format_has_a_writer(spec):
    """A family without architectures (a seeds' model type no class loads) has nothing to write."""
    family, preset = WRITTEN_AS_PRESET.get(spec.name, (spec.name, "tiny"))
    assert family in testing.FAMILIES, f"no checkpoint writer of {spec.name} in mmserve.testing"
    module = importlib.import_module(testing.FAMILIES[family].split(":")[0])
    config = getattr(module, f"{family}_config")(preset)
    assert registry.family_for_config(config).name == spec.name
