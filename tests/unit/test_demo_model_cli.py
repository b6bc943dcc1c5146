"""`mmserve demo-model`: the real command writes a checkpoint that transformers loads, with the family, preset
and seed asked for; bad families / presets / arguments fail with the reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen2VLConfig

from mmserve.entrypoints.cli import main
from mmserve.testing import llava_config, make_llava_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmserve.entrypoints.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )


def test_demo_model_subprocess_writes_a_tiny_llava_that_transformers_loads(tmp_path):
    out = tmp_path / "demo"
    proc = _cli("demo-model", str(out), "--family", "llava", "--preset", "tiny", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert "%|" not in proc.stderr  # no progress bar: stderr is a pipe

    config = AutoConfig.from_pretrained(out)
    want = llava_config("tiny")
    assert isinstance(config, LlavaConfig) and config.architectures == [
        "LlavaForConditionalGeneration"
    ]
    for got, exp in (
        (config.text_config, want.text_config),
        (config.vision_config, want.vision_config),
    ):
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "num_key_value_heads",
            "image_size",
            "patch_size",
        ):
            assert getattr(got, key, None) == getattr(exp, key, None), key

    model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.device("meta"):
        reference = LlavaForConditionalGeneration(want)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert shapes["lm_head.weight"] == (want.text_config.vocab_size, want.text_config.hidden_size)

    # the seed reached the writer: same bytes as seed 3 written in-process, other bytes than seed 0
    same = make_llava_checkpoint(tmp_path / "seed3", preset="tiny", seed=3)
    other = make_llava_checkpoint(tmp_path / "seed0", preset="tiny", seed=0)
    written = (out / "model.safetensors").read_bytes()
    assert written == (same / "model.safetensors").read_bytes()
    assert written != (other / "model.safetensors").read_bytes()


def test_demo_model_subprocess_unknown_family_fails_naming_it_and_the_known_ones(tmp_path):
    proc = _cli("demo-model", str(tmp_path / "x"), "--family", "gpt5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # a usage error, not a crash
    assert "unknown model family 'gpt5'" in proc.stderr and "qwen2_vl" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_demo_model_other_family_via_main(tmp_path, capsys):
    out = tmp_path / "qwen"
    assert main(["demo-model", str(out), "--family", "qwen2_vl", "--preset", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert isinstance(AutoConfig.from_pretrained(out), Qwen2VLConfig)


def test_demo_model_unknown_preset_and_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo-model", str(tmp_path / "p"), "--preset", "llava-13b"])
    assert exc.value.code == 2
    assert re.search(r"unknown llava preset 'llava-13b'.*'tiny'", capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:
        main(["demo-model", str(tmp_path / "f"), "--family", "nope"])
    assert exc.value.code == 2 and "unknown model family 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo-model"])  # OUT is required
    assert exc.value.code == 2 and "out_dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo-model", str(tmp_path / "s"), "--seed", "three"])
    assert exc.value.code == 2 and "--seed" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo-model", str(tmp_path / "u"), "--text-layers", "1"])
    assert (
        exc.value.code == 2 and "unrecognized arguments: --text-layers 1" in capsys.readouterr().err
    )
    assert not any(tmp_path.iterdir())
