"""`--dataset FILE.jsonl`: a bench workload read from a local JSONL file, one request per line.

A line is either `{"prompt": str, "images": [path, ...], "output_len": int}` (images and output_len optional), or
a ShareGPT4V / LLaVA-instruct record `{"image": path, "conversations": [{"from": "human", "value": "<image>\\n..."},
{"from": "gpt", "value": "..."}]}`: the first human turn is the prompt, the gpt turn after it gives the output
length (its tokens). Paths are absolute or relative to the file's folder. `<image>` markers are removed from
prompts: each API puts the pictures where it puts them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_MARKER = "<image>"


class DatasetError(ValueError):
    """A malformed line or a missing picture, naming the file, the line and the field."""


@dataclass(frozen=True)
class DatasetRequest:
    """One line's request: the user's text, its picture files (with their sizes) and its own output length."""

    line: int  # 1-based line of the file
    prompt: str
    images: tuple[Path, ...]
    image_sizes: tuple[tuple[int, int], ...]  # (width, height) per picture
    output_len: int | None  # None: the line gives none

    def read_images(self) -> list[Any]:
        """The pictures decoded as RGB PIL images."""
        from PIL import Image

        out = []
        for path in self.images:
            with Image.open(path) as im:
                out.append(im.convert("RGB"))
        return out


def _picture(base: Path, where: str, value: Any) -> tuple[Path, tuple[int, int]]:
    from PIL import Image, UnidentifiedImageError

    if not isinstance(value, str) or not value:
        raise DatasetError(f"{where}: expected a file path, got {value!r}")
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.is_file():
        raise DatasetError(f"{where}: no picture file {str(path)!r}")
    try:
        with Image.open(path) as im:
            im.verify()
            size = im.size
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise DatasetError(f"{where}: {str(path)!r} is not a readable picture ({e})") from None
    return path, size


def _plain_line(obj: dict[str, Any], where: str) -> tuple[str, list[Any], int | None]:
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: field 'prompt' must be a string, got {type(prompt).__name__}")
    images = obj.get("images", [])
    if not isinstance(images, list):
        raise DatasetError(f"{where}: field 'images' must be a list of paths")
    output_len = obj.get("output_len")
    if output_len is not None and (
        isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1
    ):
        raise DatasetError(
            f"{where}: field 'output_len' must be an integer >= 1, got {output_len!r}"
        )
    return prompt, images, output_len


def _conversation_line(
    obj: dict[str, Any], where: str, count_tokens: Callable[[str], int]
) -> tuple[str, list[Any], int | None]:
    turns = obj["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DatasetError(
            f"{where}: field 'conversations' must be a list of {{from, value}} turns"
        )
    human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
    if human is None or not isinstance(turns[human].get("value"), str):
        raise DatasetError(
            f"{where}: field 'conversations' has no human turn with a string 'value'"
        )
    answer = next((t.get("value") for t in turns[human + 1 :] if t.get("from") == "gpt"), None)
    if answer is not None and not isinstance(answer, str):
        raise DatasetError(
            f"{where}: field 'conversations': the gpt turn's 'value' must be a string"
        )
    image = obj.get("image")
    images = [] if image is None else image if isinstance(image, list) else [image]
    output_len = max(1, count_tokens(answer)) if answer else None
    return turns[human]["value"], images, output_len


def _parse_line(
    text: str, base: Path, where: str, count_tokens: Callable[[str], int]
) -> tuple[str, list[Path], list[tuple[int, int]], int | None]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "prompt" in obj:
        prompt, images, output_len = _plain_line(obj, where)
        field = "images"
    elif "conversations" in obj:
        prompt, images, output_len = _conversation_line(obj, where, count_tokens)
        field = "image"
    else:
        raise DatasetError(f"{where}: needs a 'prompt' field or a 'conversations' field")
    pictures = [_picture(base, f"{where}: field '{field}'[{i}]", v) for i, v in enumerate(images)]
    prompt = prompt.replace(IMAGE_MARKER, "").strip()
    return prompt, [p for p, _ in pictures], [s for _, s in pictures], output_len


def _words(text: str) -> int:
    return len(text.split())


def load_dataset(
    path: str,
    num_requests: int,
    count_tokens: Callable[[str], int] | None = None,
    note: bool = True,
) -> list[DatasetRequest]:
    """The first `num_requests` requests of the file (cycling its lines, with a note on stderr unless `note` is
    off, when it has fewer); `count_tokens` counts an answer's tokens (None: its words)."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"--dataset: no file {path!r}")
    if num_requests < 1:
        raise DatasetError(f"--num-requests must be >= 1, got {num_requests}")
    base = file.resolve().parent
    requests: list[DatasetRequest] = []
    with open(file, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            if len(requests) == num_requests:
                break
            if not text.strip():
                continue
            prompt, images, sizes, output_len = _parse_line(
                text, base, f"{path} line {number}", count_tokens or _words
            )
            requests.append(DatasetRequest(number, prompt, tuple(images), tuple(sizes), output_len))
    if not requests:
        raise DatasetError(f"--dataset: {path} has no requests")
    if len(requests) < num_requests and note:
        print(
            f"--dataset: {path} has {len(requests)} requests; cycling them to make {num_requests}",
            file=sys.stderr,
        )
    return [requests[i % len(requests)] for i in range(num_requests)]


def output_lens(requests: list[DatasetRequest], given: int | None, default: int) -> list[int]:
    """Each request's output length: `given` (--output-len) for all, else the line's own, else `default`."""
    if given is not None:
        return [given] * len(requests)
    return [r.output_len or default for r in requests]
