"""Calibration: the samples (a JSONL file of prompts and pictures, or the built-in set) run through mmserve's own
serving path (`mmserve.LLM`: the family's processor, vision tower and decoder on the chosen device), with forward
hooks on the decoder linears collecting, per linear, the statistics of its input channels: mean |x| and max |x|
over every calibration token, and a uniform sample of at most `sample_rows` input rows (AWQ's scale search).

Memory of the statistics: 2 x in_features floats per linear; of the rows: sample_rows x in_features x 4 bytes per
linear (256 rows of a 7B Llama: 4 x 4096 + 11008 columns, about 44 MiB per decoder layer, 1.4 GiB in all), kept on
the calibration device.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image
from torch import nn

# the built-in set: synthetic pictures (a gradient with random rectangles, ellipses and lines per seed, at varied
# sizes) paired with varied questions; a stand-in for real pictures when none are given, not a dataset
BUILTIN_QUESTIONS = (
    "What is shown in this picture?",
    "Describe the image in detail.",
    "What colors do you see, and where are they?",
    "How many shapes are there in the image?",
    "Is there any text in the picture? If so, what does it say?",
    "What is in the top left corner of the image?",
    "Write a short story inspired by this picture.",
    "Which object is the largest, and which is the smallest?",
    "Explain what makes this image interesting to a child.",
    "List the objects in the picture from left to right.",
    "Does the image look like a photograph or a drawing? Why?",
    "Summarize the scene in one sentence.",
    "What might have happened just before this picture was taken?",
    "Compare the left half of the image with the right half.",
    "Give this picture a title and explain your choice.",
    "Answer briefly: what is the dominant color?",
)
BUILTIN_SIZES = ((336, 336), (512, 384), (384, 512), (640, 480), (224, 224), (448, 336))


@dataclass(frozen=True)
class CalibrationSample:
    """One calibration request: the full prompt (the family's placeholders included) and its pictures."""

    prompt: str
    images: list = field(default_factory=list)  # local paths or PIL images

    def as_request(self) -> dict:
        return {"prompt": self.prompt, "images": list(self.images)}


def load_calibration_file(path: str | Path, limit: int) -> list[CalibrationSample]:
    """The first `limit` samples of a JSONL file: one {"prompt": str, "images": [local paths]} per line (blank
    lines skipped). The prompt is given whole, with the model's image placeholders where its chat template puts
    them, as `mmserve.LLM.generate` takes it. Raises ValueError naming the line of a bad entry."""
    samples: list[CalibrationSample] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
                raise ValueError(f'{where}: expected an object with a string "prompt"')
            images = entry.get("images", [])
            if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
                raise ValueError(f'{where}: "images" must be a list of file paths')
            base = Path(path).parent
            resolved = [str(p if Path(p).is_absolute() else base / p) for p in images]
            missing = [p for p in resolved if not Path(p).is_file()]
            if missing:
                raise ValueError(f"{where}: no such picture {missing[0]!r}")
            samples.append(CalibrationSample(entry["prompt"], resolved))
            if len(samples) == limit:
                break
    if not samples:
        raise ValueError(f"{path}: no calibration samples")
    return samples


def builtin_samples(model_dir: str, n: int, seed: int = 0) -> list[CalibrationSample]:
    """`n` samples of the built-in set, each one picture + one question wrapped in the checkpoint's own prompt
    template (its chat template, else `Question: ... Answer:` after the picture's placeholder)."""
    from mmserve.bench.workload import PromptTemplate
    from mmserve.testing import make_test_image

    template = PromptTemplate(model_dir)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        question = BUILTIN_QUESTIONS[i % len(BUILTIN_QUESTIONS)]
        w, h = rng.choice(BUILTIN_SIZES)
        # drawn small and scaled up (bilinear): soft shapes, and fast (make_test_image draws pixel by pixel)
        image = make_test_image(seed * 100_003 + i, (w // 8, h // 8)).resize((w, h), Image.BILINEAR)
        out.append(CalibrationSample(template.wrap(question), [image]))
    return out


class InputStats:
    """One linear's input statistics, accumulated over the calibration tokens."""

    def __init__(self, in_features: int, sample_rows: int, device: torch.device, seed: int) -> None:
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64, device=device)
        self.abs_max = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.tokens = 0
        self.sample_rows = sample_rows
        self.rows = torch.empty(0, in_features, dtype=torch.float32, device=device)
        self._keys = torch.empty(0, dtype=torch.float32, device=device)
        self._gen = torch.Generator(device=device).manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        a = x.abs()
        self.abs_sum += a.sum(dim=0, dtype=torch.float64)
        self.abs_max = torch.maximum(self.abs_max, a.amax(dim=0))
        self.tokens += x.shape[0]
        # bottom-k of uniform random keys over every row seen: a uniform sample without replacement
        keys = torch.rand(x.shape[0], generator=self._gen, device=x.device)
        keys, rows = torch.cat([self._keys, keys]), torch.cat([self.rows, x])
        if len(keys) > self.sample_rows:
            keep = keys.topk(self.sample_rows, largest=False).indices
            keys, rows = keys[keep], rows[keep]
        self._keys, self.rows = keys, rows

    @property
    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.tokens, 1)).float()


def collect_input_stats(
    llm,
    linears: dict[str, nn.Module],
    samples: list[CalibrationSample],
    sample_rows: int,
    seed: int,
) -> dict[str, InputStats]:
    """Run `samples` through `llm` (one generated token each: the prompt's forward pass) with a forward hook on
    each of `linears` (our module name -> module); returns each one's `InputStats`."""
    from mmserve import SamplingParams

    stats: dict[str, InputStats] = {}
    handles = []
    for i, (name, module) in enumerate(linears.items()):
        weight = module.weight
        stats[name] = InputStats(weight.shape[1], sample_rows, weight.device, seed + i)
        handles.append(
            module.register_forward_hook(lambda m, args, out, s=stats[name]: s.add(args[0]))
        )
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([s.as_request() for s in samples], params, use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    idle = [name for name, s in stats.items() if s.tokens == 0]
    if idle:
        raise RuntimeError(f"calibration never ran decoder linear {idle[0]} (hooks saw no input)")
    return stats
