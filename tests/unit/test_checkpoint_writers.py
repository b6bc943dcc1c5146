"""mmserve.testing finds its checkpoint writers and test cases in its own modules (each module's CHECKPOINT_WRITERS
and TEST_CASES), and every registered model family with a checkpoint format has a writer: its own, or a tiny
preset of another family's writer."""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any

import pytest

import mmserve.testing as testing
from mmserve.models import registry


def _config(family: str, preset: str | None = None) -> Any:
    """The config of a preset of ``family``'s writer (its module's ``<family>_config``; None: its default)."""
    module = importlib.import_module(testing.FAMILIES[family].split(":")[0])
    make = getattr(module, f"{family}_config")
    return make() if preset is None else make(preset)


@functools.cache
def _families_of_tiny_presets() -> set[str]:
    """The registered families that load a tiny preset of some writer."""
    found = set()
    for family, path in testing.FAMILIES.items():
        presets = importlib.import_module(path.split(":")[0]).PRESETS
        for preset in (p for p in presets if p.startswith("tiny")):
            found.add(registry.family_for_config(_config(family, preset)).name)
    return found


def test_families_are_the_testing_modules_checkpoint_writers():
    writers = testing.checkpoint_writers()
    assert list(testing.FAMILIES) == list(writers)
    # the demo model's first (`mmserve demo-model`'s default), the others by name
    assert next(iter(writers)) == testing.DEMO_FAMILY == "llava"
    assert list(writers)[1:] == sorted(list(writers)[1:])
    for family, path in testing.FAMILIES.items():
        module_name, name = path.split(":")
        module = importlib.import_module(module_name)
        assert module.CHECKPOINT_WRITERS[family] is getattr(module, name)
        assert writers[family] is getattr(module, name)
    known = re.escape(", ".join(sorted(writers)))
    with pytest.raises(ValueError, match=f"unknown model family 'nope'; known families: {known}$"):
        testing.make_checkpoint("nope", "/nonexistent")


def test_each_writer_writes_the_family_it_is_named_after():
    """A writer keyed by a registered family's name writes that family (its default preset); another key names a
    version of the family it writes (cogvlm2: CogVLM2 checkpoints, which the cogvlm family loads)."""
    names = {spec.name for spec in registry.families()}
    for family in testing.checkpoint_writers():
        loaded_as = registry.family_for_config(_config(family)).name
        assert loaded_as == family if family in names else family.startswith(loaded_as), family


def test_a_family_with_two_writers_is_an_error(monkeypatch):
    from mmserve.testing import fuyu

    monkeypatch.setattr(testing, "_WRITERS", {})
    monkeypatch.setattr(
        fuyu, "CHECKPOINT_WRITERS", {**fuyu.CHECKPOINT_WRITERS, "llava": fuyu.make_fuyu_checkpoint}
    )
    with pytest.raises(ValueError, match="'llava' has two checkpoint writers"):
        testing.checkpoint_writers()


@pytest.mark.parametrize(
    ("family", "written_by"),
    [("llava", "mmserve.testing.llava:make_llava_checkpoint"), ("nope", "no module")],
)
def test_a_test_case_of_a_family_its_module_does_not_write_is_an_error(
    family, written_by, monkeypatch
):
    from mmserve.testing import fuyu

    monkeypatch.setattr(testing, "_CASES", {})
    monkeypatch.setattr(fuyu, "TEST_CASES", {**fuyu.TEST_CASES, family: testing.FamilyCase()})
    with pytest.raises(ValueError) as err:
        testing.family_cases()
    assert str(err.value) == (
        f"mmserve.testing.fuyu declares a test case of model family {family!r}, "
        f"written by {written_by}"
    )


def test_family_cases_follow_the_writers_order():
    cases = testing.family_cases()
    assert "fuyu" in cases and isinstance(cases["fuyu"], testing.FamilyCase)
    assert list(cases) == [f for f in testing.checkpoint_writers() if f in cases]


@pytest.mark.parametrize(
    "spec", [s for s in registry.families() if s.architectures], ids=lambda s: s.name
)
def test_every_family_with_a_checkpoint_format_has_a_writer(spec):
    """A family without architectures (a seeds' model type no class loads) has nothing to write."""
    if spec.name in testing.FAMILIES:  # its own writer's tiny preset
        assert registry.family_for_config(_config(spec.name, "tiny")).name == spec.name
    else:  # a tiny preset of another family's writer (BLIP-2 T5: blip2's "tiny-t5")
        assert spec.name in _families_of_tiny_presets(), (
            f"no checkpoint writer of {spec.name} in mmserve.testing"
        )
