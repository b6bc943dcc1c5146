"""What every bench shares: the model source (checkpoint dir or preset), the prompts (1 image + N text
tokens), distinct synthetic images, device timing, and the environment record of a run.

Imports only torch/transformers/PIL lazily, so `mmserve bench serve` runs without a model stack.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRESETS = ("tiny", "tiny-mha", "llava-1.5-7b")
DEFAULT_WORK_DIR = "/tmp/mmserve-bench"
FILLER_WORDS = (" the", " a", " image", " is", " and", " of")


@dataclass
class ModelSource:
    """A checkpoint directory, or a preset whose random checkpoint is written once into work_dir."""

    model: str | None = None        # HF checkpoint directory
    preset: str | None = None       # tiny | tiny-mha | llava-1.5-7b
    work_dir: str = DEFAULT_WORK_DIR

    def __post_init__(self) -> None:
        if self.model is None and self.preset is None:
            raise ValueError("give --model DIR or --preset NAME")
        if self.model is not None and self.preset is not None:
            raise ValueError("give either --model or --preset, not both")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")

    def resolve(self) -> str:
        """The checkpoint directory; a preset's checkpoint is built on first use and reused after."""
        if self.model is not None:
            if not (Path(self.model) / "config.json").is_file():
                raise FileNotFoundError(f"{self.model} has no config.json")
            return self.model
        target = Path(self.work_dir) / self.preset
        if (target / ".complete").is_file():
            return str(target)
        from mmserve.testing import make_llava_checkpoint

        tmp = Path(f"{target}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"writing a random {self.preset} checkpoint to {target} (once) ...", file=sys.stderr, flush=True)
        make_llava_checkpoint(tmp, preset=self.preset)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
        return str(target)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    return "float16" if device.startswith("cuda") else "float32"


def torch_dtype(name: str) -> Any:
    import torch

    table = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def sync(device: str) -> None:
    """Wait for queued device work, so wall-clock timings cover it."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def now() -> float:
    return time.perf_counter()


def free_device_memory(device: str) -> None:
    """Return cached blocks after a phase, so the next one (mmserve or hf) gets the memory."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ---- prompts and images ---------------------------------------------------------------------

@dataclass(frozen=True)
class PromptSpec:
    """One llava-1.5 style prompt: `USER: <image>\\n` + filler + ` ASSISTANT:` with `text_tokens` text tokens."""

    text: str            # full prompt with one <image> placeholder
    filler: str          # the user text alone (what a server request sends)
    text_tokens: int     # tokens of `text` besides the image placeholder (BOS included)


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text).input_ids)


def _single_token_word(tokenizer: Any) -> str:
    for w in FILLER_WORDS:
        if len(tokenizer(w, add_special_tokens=False).input_ids) == 1:
            return w
    return FILLER_WORDS[0]


def make_filler(tokenizer: Any | None, n_tokens: int) -> str:
    """User text of `n_tokens` tokens (one per repeated word); without a tokenizer, n words of ' the'."""
    word = _single_token_word(tokenizer) if tokenizer is not None else FILLER_WORDS[0]
    return (word * max(n_tokens, 0)).strip()


def make_prompt(tokenizer: Any, input_len: int, image_token: str = "<image>") -> PromptSpec:
    """The prompt whose text (all tokens but the image's) is `input_len` tokens, or as close as the template allows."""
    template = "USER: " + image_token + "\n{} ASSISTANT:"
    word = _single_token_word(tokenizer)

    def text_tokens(k: int) -> int:
        return _count_tokens(tokenizer, template.format((word * k).strip())) - 1  # minus the <image> token

    k = max(0, input_len - text_tokens(0))
    for _ in range(8):  # a filler word is one token, so this settles in one or two tries
        got = text_tokens(k)
        if got == input_len or (got > input_len and k == 0):
            break
        k = max(0, k + input_len - got)
    filler = (word * k).strip()
    return PromptSpec(template.format(filler), filler, text_tokens(k))


def image_size_of(model_dir: str) -> int:
    """The vision tower's input side (336 for llava-1.5), so images need no up/down-scaling cost surprises."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("vision_config", {}).get("image_size", 336))


def make_images(n: int, size: int, seed: int = 0) -> list[Any]:
    """`n` distinct RGB noise images (distinct content: no encoder- or prefix-cache hits between requests)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB") for _ in range(n)]


# ---- environment ----------------------------------------------------------------------------

def environment(device: str, argv: list[str] | None) -> dict[str, Any]:
    """Device name, versions, UTC date and the exact command line of this run."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "mmserve bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "process_argv": shlex.join(sys.argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": device,
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if device.startswith("cuda") and torch.cuda.is_available():
            env["device_name"] = torch.cuda.get_device_name(torch.device(device))
            env["cuda"] = torch.version.cuda
        else:
            env["device_name"] = platform.processor() or platform.machine()
    except ImportError:
        env["device_name"] = platform.machine()
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    import mmserve

    env["mmserve"] = mmserve.__version__
    return env
