"""The checkpoint writer's progress bar (mmserve.testing.writer): shown on a terminal, over the bytes written,
absent when stderr is not a terminal or progress=False, and never changing a byte of what is written."""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from tqdm import tqdm
from transformers import LlavaForConditionalGeneration

from mmserve.testing.llava import (
    checkpoint_key,
    llava_config,
    llava_param_specs,
    llava_sizes,
    make_llava_checkpoint,
)
from mmserve.testing.writer import write_safetensors, write_sharded_weights

SEED = 4


class FakeTerminal(io.StringIO):
    """A stderr that says it is a terminal and keeps what was written to it."""

    def isatty(self) -> bool:
        return True


class NotATerminal(io.StringIO):
    def isatty(self) -> bool:
        return False


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _tensor_bytes(d: Path) -> int:
    """Bytes of tensor data in the safetensors files of d (file size minus the 8-byte length and the header)."""
    total = 0
    for f in d.glob("*.safetensors"):
        raw = f.read_bytes()
        total += len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]
    return total


@pytest.mark.parametrize("max_shard_bytes", [4_000_000_000, 300_000], ids=["one-file", "sharded"])
def test_progress_on_and_off_write_byte_identical_checkpoints(
    tmp_path, monkeypatch, max_shard_bytes
):
    # on: stderr is a terminal, progress left at its default
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    on = make_llava_checkpoint(
        tmp_path / "on", preset="tiny", seed=SEED, max_shard_bytes=max_shard_bytes
    )
    shown = terminal.getvalue()
    total = _tensor_bytes(on)
    size = tqdm.format_sizeof(total, divisor=1024)
    assert "writing on" in shown and "100%" in shown and f"{size}/{size}" in shown, shown
    shards = sorted(p.name for p in on.glob("*.safetensors"))
    assert (len(shards) > 1) == (max_shard_bytes == 300_000)
    assert shards[-1] in shown  # the bar names the file being written

    # off: stderr is not a terminal
    pipe = NotATerminal()
    monkeypatch.setattr(sys, "stderr", pipe)
    off = make_llava_checkpoint(
        tmp_path / "off", preset="tiny", seed=SEED, max_shard_bytes=max_shard_bytes
    )
    assert pipe.getvalue() == ""
    assert _files(off) == _files(on)  # every file, config and tokenizer included

    # off: progress=False on a terminal (the weights alone, through the same specs make_llava_checkpoint uses)
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    specs = llava_param_specs(
        LlavaForConditionalGeneration, llava_config("tiny"), llava_sizes("tiny")
    )
    flag_off = tmp_path / "flag_off"
    flag_off.mkdir()
    write_sharded_weights(
        flag_off, specs, checkpoint_key, "float32", SEED, max_shard_bytes, progress=False
    )
    assert terminal.getvalue() == ""
    weights = {k: v for k, v in _files(on).items() if k.startswith("model")}
    assert _files(flag_off) == weights

    # and what was written loads in transformers
    model = LlavaForConditionalGeneration.from_pretrained(on)
    assert sum(p.numel() * p.element_size() for p in model.state_dict().values()) == total


def test_write_safetensors_reports_each_tensors_bytes_once(tmp_path):
    entries = [("a", (3, 5)), ("empty", (0, 4)), ("b", (7,))]
    tensors = [
        torch.arange(15, dtype=torch.float32).reshape(3, 5),
        torch.zeros(0, 4),
        torch.ones(7),
    ]
    seen: list[int] = []
    write_safetensors(
        tmp_path / "x.safetensors", entries, torch.float32, lambda i: tensors[i], seen.append
    )
    assert seen == [60, 0, 28]
    assert sum(seen) == _tensor_bytes(tmp_path)
    raw = (tmp_path / "x.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["b"]["data_offsets"] == [60, 88]
