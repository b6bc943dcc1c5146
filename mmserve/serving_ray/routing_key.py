"""The routing key of one HTTP request to mmserve: what makes two requests share cached work on a replica.

A request with pictures (or videos) is keyed by them: the hash of every media reference it sends (a data URI's
content, a URL as written), in order, so the same picture asked different questions goes to one replica, where its
vision encoding and the prompt prefix up to it are cached. A request without media is keyed by the first
`prefix_chars` characters of its prompt text. Neither: no key (the least-loaded replica takes it).

The body is read as JSON without knowing the API: every string value that is a media reference counts as a picture,
and the text fields of the Triton (`text_input`), KServe v2 (`inputs[].data` of `text_input`) and OpenAI (`prompt`,
`messages[].content`, content parts' `text`) shapes make the prompt, in document order."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

PREFIX_CHARS = 256  # about the first 64 tokens: a system prompt or a shared instruction
MEDIA_PREFIXES = ("data:", "http://", "https://", "file:")
TEXT_KEYS = frozenset({"text_input", "prompt", "content", "text", "input"})
MAX_MEDIA_REFS = 64  # hashing stops there; what follows changes nothing about where a request goes


def routing_key(body: bytes, prefix_chars: int = PREFIX_CHARS) -> str | None:
    """The key of a request body (JSON): "media:<hash>" or "prefix:<hash>"; None when it has neither media nor
    prompt text, or is not JSON (the replica answers the error)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    media = hashlib.blake2b(digest_size=16)
    n_media, text = 0, []
    for key, value in _strings(doc, None):
        if value.startswith(MEDIA_PREFIXES):
            if n_media < MAX_MEDIA_REFS:
                media.update(hashlib.blake2b(value.encode(), digest_size=16).digest())
            n_media += 1
        elif key in TEXT_KEYS and sum(map(len, text)) < prefix_chars:
            text.append(value)
    if n_media:
        return "media:" + media.hexdigest()
    prompt = "".join(text)[:prefix_chars]
    if not prompt:
        return None
    return "prefix:" + hashlib.blake2b(prompt.encode(), digest_size=16).hexdigest()


def _strings(node: Any, key: str | None) -> Iterator[tuple[str | None, str]]:
    """(the key it sits under, value) for every string in a JSON document, in document order. A KServe input's
    `data` is reported under the input's `name`, so `{"name": "text_input", "data": [...]}` is prompt text."""
    if isinstance(node, str):
        yield key, node
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item, key)
    elif isinstance(node, dict):
        data_key = node.get("name") if isinstance(node.get("name"), str) else None
        for k, v in node.items():
            yield from _strings(v, data_key if k == "data" and data_key else k)
