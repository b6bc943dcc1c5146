"""`--dataset FILE.jsonl`: a bench workload read from a local JSONL file, one request per line.

Each line is one of three layouts, told apart by its fields:

- plain: `{"prompt": str, "images": [picture, ...], "output_len": int}` (images and output_len optional);
- ShareGPT4V / LLaVA-instruct: `{"image": picture, "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}]}`;
- VisionArena-Chat (lmarena-ai/VisionArena-Chat rows exported to JSONL): `{"images": [picture, ...],
  "conversation": [[{"role": "user", "content": "..."}], [{"role": "assistant", "content": "..."}]]}`. The hub
  declares `conversation` as a list of turns, each a one-message list; flat `{role, content}` turns are read too.

In the conversation layouts the first human / user turn is the prompt and the gpt / assistant turn after it gives
the output length (its tokens). A picture is a file path (absolute or relative to the file's folder), `{"path":
...}`, or `{"bytes": base64}` (a `datasets` Image value with its bytes as base64 text; bytes win over a path, as
`datasets` decodes them). `<image>` markers are removed from prompts: each API puts the pictures where it puts them.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
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
    images: tuple[Path, ...]  # embedded pictures are files in a temporary folder, removed at exit
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _probe(where: str, source: Path | bytes) -> tuple[str, tuple[int, int]]:
    """The picture's format and (width, height), or an error naming where it came from."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(source if isinstance(source, Path) else io.BytesIO(source)) as im:
            im.verify()
            return im.format or "", im.size
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        if isinstance(source, Path):
            raise DatasetError(
                f"{where}: {str(source)!r} is not a readable picture ({e})"
            ) from None
        what = f"{len(source)} bytes starting {source[:8]!r}"
        raise DatasetError(
            f"{where}: the decoded bytes are not a readable picture ({what})"
        ) from None


_spill: list[Path] = []


def _spill_dir() -> Path:
    if not _spill:
        _spill.append(Path(tempfile.mkdtemp(prefix="mmserve-dataset-")))
        # only the process that made the folder removes it (not a forked child exiting normally)
        owner = os.getpid()
        atexit.register(
            lambda: os.getpid() == owner and shutil.rmtree(_spill[0], ignore_errors=True)
        )
    return _spill[0]


def _embedded(where: str, data: Any) -> tuple[Path, tuple[int, int]]:
    # The benches send a picture file's own bytes and read pictures by path, so an embedded picture is written
    # once to a file named by its hash (a picture repeated across lines or loads is one file).
    if not isinstance(data, str):
        raise DatasetError(f"{where}: expected base64 text, got {type(data).__name__}")
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise DatasetError(f"{where}: not base64 text") from None
    fmt, size = _probe(where, raw)
    path = _spill_dir() / f"{hashlib.sha256(raw).hexdigest()[:32]}.{fmt.lower() or 'img'}"
    if not path.exists():
        path.write_bytes(raw)
    return path, size


def _picture(base: Path, where: str, value: Any) -> tuple[Path, tuple[int, int]]:
    if isinstance(value, dict) and value.get("bytes") is not None:
        return _embedded(f"{where}['bytes']", value["bytes"])
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        where, value = f"{where}['path']", value["path"]
    if not isinstance(value, str) or not value:
        raise DatasetError(
            f"{where}: expected a file path, {{'path': ...}} or {{'bytes': base64}}, got {_short(value)}"
        )
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.is_file():
        raise DatasetError(f"{where}: no picture file {str(path)!r}")
    return path, _probe(where, path)[1]


def _plain_line(obj: dict[str, Any], where: str) -> tuple[str, list[Any], int | None]:
    prompt = obj["prompt"]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: field 'prompt' must be a string, got {type(prompt).__name__}")
    images = obj.get("images", [])
    if not isinstance(images, list):
        raise DatasetError(f"{where}: field 'images' must be a list of pictures")
    output_len = obj.get("output_len")
    if output_len is not None and (
        isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1
    ):
        raise DatasetError(
            f"{where}: field 'output_len' must be an integer >= 1, got {output_len!r}"
        )
    return prompt, images, output_len


def _first_exchange(
    turns: list[dict[str, Any]], where: str, field: str, keys: tuple[str, str, str, str]
) -> tuple[str, str | None]:
    """The first asker turn's text and the answer turn after it (None: none); `keys` names the turn's speaker
    and text fields and the asker's and answerer's names."""
    who, text, asker, answerer = keys
    first = next((i for i, t in enumerate(turns) if t.get(who) == asker), None)
    if first is None or not isinstance(turns[first].get(text), str):
        raise DatasetError(f"{where}: field '{field}' has no {asker} turn with a string '{text}'")
    answer = next((t.get(text) for t in turns[first + 1 :] if t.get(who) == answerer), None)
    if answer is not None and not isinstance(answer, str):
        raise DatasetError(
            f"{where}: field '{field}': the {answerer} turn's '{text}' must be a string"
        )
    return turns[first][text], answer


def _conversation_line(
    obj: dict[str, Any], where: str, count_tokens: Callable[[str], int]
) -> tuple[str, list[Any], int | None]:
    turns = obj["conversations"]
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        raise DatasetError(
            f"{where}: field 'conversations' must be a list of {{from, value}} turns"
        )
    prompt, answer = _first_exchange(
        turns, where, "conversations", ("from", "value", "human", "gpt")
    )
    image = obj.get("image")
    images = [] if image is None else image if isinstance(image, list) else [image]
    output_len = max(1, count_tokens(answer)) if answer else None
    return prompt, images, output_len


def _arena_line(
    obj: dict[str, Any], where: str, count_tokens: Callable[[str], int]
) -> tuple[str, list[Any], int | None]:
    turns = obj["conversation"]
    messages = None
    if isinstance(turns, list):  # the hub wraps each turn in a one-message list
        messages = [m for t in turns for m in (t if isinstance(t, list) else [t])]
    if messages is None or not all(isinstance(m, dict) for m in messages):
        raise DatasetError(
            f"{where}: field 'conversation' must be a list of turns, each [{{role, content}}]"
        )
    keys = ("role", "content", "user", "assistant")
    prompt, answer = _first_exchange(messages, where, "conversation", keys)
    images = obj.get("images")
    images = [] if images is None else images
    if not isinstance(images, list):
        raise DatasetError(f"{where}: field 'images' must be a list of pictures")
    output_len = max(1, count_tokens(answer)) if answer else None
    return prompt, images, output_len


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
    elif "conversation" in obj:
        prompt, images, output_len = _arena_line(obj, where, count_tokens)
        field = "images"
    else:
        raise DatasetError(
            f"{where}: fits no layout: needs a 'prompt' field (plain), a 'conversations' field"
            " (ShareGPT4V / LLaVA) or a 'conversation' field (VisionArena-Chat)"
        )
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
