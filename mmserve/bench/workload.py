"""What every bench shares: the model source (checkpoint dir, or a family's preset), the prompts (1 image +
N text tokens in the checkpoint's own chat template), distinct synthetic images, device timing, and the
environment record of a run.

Imports only torch/transformers/PIL (and the checkpoint writers of `mmserve.testing`) lazily, so
`mmserve bench serve` runs without a model stack.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import json
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_FAMILY = "llava"
DEFAULT_WORK_DIR = "/tmp/mmserve-bench"
DEFAULT_IMAGE_SIZE = (
    336  # families without a fixed vision input size (qwen2_vl's dynamic resolution)
)
FILLER_WORDS = (" the", " a", " image", " is", " and", " of")


def family_presets(family: str) -> tuple[str, ...]:
    """The preset names of a family of `mmserve.testing.FAMILIES`; ValueError naming the known families."""
    from mmserve.testing import FAMILIES

    if family not in FAMILIES:
        raise ValueError(
            f"unknown model family {family!r}; known families: {', '.join(sorted(FAMILIES))}"
        )
    module = importlib.import_module(FAMILIES[family].split(":")[0])
    return tuple(module.PRESETS)


@dataclass
class ModelSource:
    """A checkpoint directory, or a family's preset whose random checkpoint is written once into
    `work_dir/<family>-<preset>`."""

    model: str | None = None  # HF checkpoint directory (its config.json names the family)
    preset: str | None = None  # a preset of `family`, e.g. tiny | qwen2-vl-7b | blip2-opt-2.7b
    work_dir: str = DEFAULT_WORK_DIR
    family: str | None = None  # with preset: a key of mmserve.testing.FAMILIES (None = llava)

    def __post_init__(self) -> None:
        if self.model is None and self.preset is None:
            raise ValueError("give --model DIR or --preset NAME")
        if self.model is not None and self.preset is not None:
            raise ValueError("give either --model or --preset, not both")
        if self.model is not None:
            if self.family is not None:
                raise ValueError(
                    "--family goes with --preset; a --model checkpoint's family is in its config.json"
                )
            return
        self.family = self.family or DEFAULT_FAMILY
        presets = family_presets(self.family)
        if self.preset not in presets:
            raise ValueError(
                f"unknown {self.family} preset {self.preset!r}; {self.family} presets: "
                f"{', '.join(presets)}"
            )

    def resolve(self) -> str:
        """The checkpoint directory; a preset's checkpoint is built on first use and reused after."""
        if self.model is not None:
            from mmserve.models.registry import class_for_checkpoint

            if not (Path(self.model) / "config.json").is_file() and not class_for_checkpoint(
                self.model
            ):
                raise FileNotFoundError(f"{self.model} has no config.json")
            return self.model
        assert self.preset is not None and self.family is not None
        target = Path(self.work_dir) / f"{self.family}-{self.preset}"
        if (target / ".complete").is_file():
            return str(target)
        from mmserve.testing import make_checkpoint

        tmp = Path(f"{target}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"writing a random {self.family} {self.preset} checkpoint to {target} (once) ...",
            file=sys.stderr,
            flush=True,
        )
        make_checkpoint(self.family, tmp, preset=self.preset)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
        return str(target)


def model_record(source: ModelSource | None, model_dir: str | None) -> dict[str, Any]:
    """What the result JSON says about the checkpoint: path, family, preset and HF architecture."""
    arch = None
    if model_dir is not None:
        from mmserve.models.loader import load_hf_config

        arch = (load_hf_config(model_dir).architectures or [None])[0]
    return {
        "path": model_dir,
        "family": source.family if source else None,
        "preset": source.preset if source else None,
        "architecture": arch,
    }


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    return "float16" if device.startswith("cuda") else "float32"


def torch_dtype(name: str) -> Any:
    import torch

    table = {
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float32": torch.float32,
        "fp32": torch.float32,
    }
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
    """One prompt: the user text wrapped by the checkpoint's chat template around one image."""

    text: str  # full prompt, with the image placeholder where the template puts it (none: BLIP-2)
    filler: str  # the user text alone (what a server request sends)
    text_tokens: (
        int  # tokens of `text` besides the image placeholder (special tokens and template included)
    )


def _single_token_word(tokenizer: Any) -> str:
    for w in FILLER_WORDS:
        if len(tokenizer(w, add_special_tokens=False).input_ids) == 1:
            return w
    return FILLER_WORDS[0]


def make_filler(tokenizer: Any | None, n_tokens: int) -> str:
    """User text of `n_tokens` tokens (one per repeated word); without a tokenizer, n words of ' the'."""
    word = _single_token_word(tokenizer) if tokenizer is not None else FILLER_WORDS[0]
    return (word * max(n_tokens, 0)).strip()


class PromptTemplate:
    """How a checkpoint turns user text + one image into its prompt, from its own processor.

    With a chat template: `apply_chat_template` of one user turn holding an image part and a text part, plus the
    generation prompt. Without one: `Question: <text> Answer:`, with the processor's image placeholder in front
    unless the processor inserts the image tokens itself (BLIP-2); an encoder-decoder's (Nougat) is the text alone,
    the beginning of its decoder's answer, or (Deplot) the question drawn on the picture.
    """

    def __init__(self, model_dir: str) -> None:
        from mmserve.models.loader import load_hf_config
        from mmserve.models.registry import get_model_class

        config = load_hf_config(model_dir)
        model_cls = get_model_class(config)
        self.processor = model_cls.build_processor(model_dir, config)
        self.tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.image_token: str = getattr(self.processor, "image_token", None) or "<image>"
        self.chat_template = getattr(self.processor, "chat_template", None)
        self.placeholder_in_prompt = True
        self.decoder_prompt = (
            None  # an encoder-decoder's prompt ids of a text: its decoder's (Nougat)
        )
        self.drawn_text = False
        if not self.chat_template:
            self.placeholder_in_prompt = model_cls.family.placeholder_in_prompt
            if model_cls.family.encoder_decoder:
                self.decoder_prompt = lambda text: model_cls.decoder_prompt_ids(
                    config, self.tokenizer, text
                )
            self.drawn_text = bool(
                getattr(config, "is_vqa", False)
            )  # Deplot: the question is drawn on the picture

    def wrap(self, text: str, images: int = 1) -> str:
        """The full prompt of `images` pictures + the user `text` (an encoder-decoder's: the text that starts its
        answer): image parts in the chat template's user turn, else placeholders in front (none where the
        processor inserts them itself)."""
        if self.decoder_prompt:
            return text
        if self.chat_template:
            parts = [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": text}]
            messages = [{"role": "user", "content": parts}]
            return self.processor.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        image = f"{self.image_token}\n" if self.placeholder_in_prompt else ""
        return f"{image * images}Question: {text} Answer:"

    def text_tokens(self, prompt: str) -> int:
        """Tokens of `prompt` as the processor tokenizes it (special tokens added), minus its image placeholders; a
        question drawn on the picture counts the tokens it would be."""
        if self.drawn_text:
            return len(self.tokenizer(prompt, add_special_tokens=False).input_ids)
        if self.decoder_prompt:
            return len(self.decoder_prompt(prompt))
        placeholders = prompt.count(self.image_token) if self.placeholder_in_prompt else 0
        return len(self.tokenizer(prompt).input_ids) - placeholders


def make_prompt(template: PromptTemplate, input_len: int) -> PromptSpec:
    """The prompt whose text (all tokens but the image's) is `input_len` tokens, or as close as the template allows."""
    word = _single_token_word(template.tokenizer)

    def text_tokens(k: int) -> int:
        return template.text_tokens(template.wrap((word * k).strip()))

    k = max(0, input_len - text_tokens(0))
    for _ in range(8):  # a filler word is one token, so this settles in one or two tries
        got = text_tokens(k)
        if got == input_len or (got > input_len and k == 0):
            break
        k = max(0, k + input_len - got)
    filler = (word * k).strip()
    return PromptSpec(template.wrap(filler), filler, text_tokens(k))


def prompt_variants(template: PromptTemplate, spec: PromptSpec, n: int) -> list[str]:
    """n prompts like `spec` (same token count), each with its own user text: the last filler words spell
    the prompt's index in a base of the tokenizer's one-token filler words (words after a space, as
    the tokenizer saw them when they were counted). Prompts then share the template
    and the image but not the text, as different questions about one picture do. Falls back to `spec.text`
    for every prompt when the tokenizer has fewer than two such words or the text is too short."""
    words = [
        w
        for w in FILLER_WORDS
        if len(template.tokenizer(w, add_special_tokens=False).input_ids) == 1
    ]
    filler = spec.filler.split(" ")
    base = len(words)
    digits = 1
    while base > 1 and base**digits < n:
        digits += 1
    if base < 2 or digits >= len(filler):  # the first word has no space before it
        return [spec.text] * n
    out = []
    for i in range(n):
        code, x = [], i
        for _ in range(digits):
            code.append(words[x % base].strip())
            x //= base
        text = template.wrap(" ".join(filler[: len(filler) - digits] + code))
        if template.text_tokens(text) != spec.text_tokens:
            return [spec.text] * n
        out.append(text)
    return out


def image_size_of(model_dir: str) -> int:
    """The side of the square bench images: the vision tower's input size where the config fixes one (llava
    336, llava_next 336 (its anyres then tiles it), llava_onevision 384, blip2 224), else 336 (qwen2_vl)."""
    file = Path(model_dir) / "config.json"
    cfg = json.loads(file.read_text()) if file.is_file() else {}
    size = (cfg.get("vision_config") or {}).get("image_size")
    if (
        size is None and "vision_config" not in cfg
    ):  # a family reading its parts itself (VILA, NeVA)
        from mmserve.models.loader import load_hf_config

        vision = getattr(load_hf_config(model_dir), "vision_config", None)
        size = getattr(vision, "image_size", None)
    return int(size or DEFAULT_IMAGE_SIZE)


def make_images(n: int, size: int, seed: int = 0, height: int | None = None) -> list[Any]:
    """`n` distinct RGB noise images, `size` wide and `height` (default `size`) high (distinct content: no
    encoder- or prefix-cache hits between requests)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    shape = (height or size, size, 3)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), "RGB") for _ in range(n)]


# ---- environment ----------------------------------------------------------------------------


def redact_headers(args: list[str]) -> list[str]:
    """The command line with each `--header KEY=VALUE`'s value hidden: results files must not keep credentials."""
    out, hide = [], False
    for arg in args:
        if hide or arg.startswith("--header="):
            prefix = "--header=" if arg.startswith("--header=") else ""
            arg = prefix + arg.removeprefix(prefix).partition("=")[0] + "=<redacted>"
        hide = arg == "--header"
        out.append(arg)
    return out


def environment(device: str, argv: list[str] | None) -> dict[str, Any]:
    """Device name, versions, UTC date and the exact command line of this run."""
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "mmserve bench "
        + shlex.join(redact_headers(argv if argv is not None else sys.argv[1:])),
        "process_argv": shlex.join(redact_headers(sys.argv)),
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
