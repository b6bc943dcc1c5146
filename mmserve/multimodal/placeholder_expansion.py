"""Placeholder runs in prompt ids (`placeholder_runs`, `equal_runs`: where each picture's placeholder tokens are),
and PlaceholderExpansion: image prompts without tokenizing the processor's expanded text.

The HF processors of the placeholder families (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Pixtral) write each
image's placeholder token N times into the prompt string (N = the image's feature count, 576 for a LLaVA-1.5
picture; Pixtral closes each row of them with [IMG_BREAK] and the last with [IMG_END]) and tokenize that string;
tokenizing and converting the 600-token result is about half of the processor's time for one picture. The
placeholder is a special token, so the tokenizer splits the text around it: tokenizing the prompt as written and
putting the image's expansion (its run of ids) where its placeholder id is gives the same ids.

The expansion depends only on the image's size for these processors, so it is learned per (width, height) from the
real processor's runs (and per number of images in the prompt, since a processor may expand an image of a
multi-image prompt differently); the first learned run is also redone the short way and compared, key by key, with the
processor's output. Any difference (another tokenizer behaviour, processor-side kwargs, extra outputs) turns
the shortcut off for good, so the processor stays the oracle.

Up to MAX_SIZES keys are kept (the oldest learned goes first), each expansion run-length encoded (pack_run): one
(id, repeat) pair for LLaVA-1.5's 576 placeholders or a Qwen2-VL picture's thousands, two per row for Pixtral's;
~0.3 KB an entry with its key, ~1 MB at the cap. As tuples of Python ints (40 bytes an id), traffic of pictures of
random sizes would fill the cap with 91 MB for LLaVA-1.5 and ~2.6 GB for Qwen2-VL's largest pictures.
"""

from __future__ import annotations

import itertools
import logging
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

Size = tuple[int, int]
Key = tuple[int, int, int]  # (width, height, images in the prompt)
# processor outputs that the shortcut leaves out: no model class reads them (per-token modality ids)
UNUSED_KEYS = frozenset({"mm_token_type_ids"})


def pack_run(run: Sequence[int]) -> array:
    """An expansion run-length encoded: (id, repeat) pairs, flat, as int64."""
    packed = array("q")
    for t in run:
        if packed and packed[-2] == t:
            packed[-1] += 1
        else:
            packed.extend((t, 1))
    return packed


def unpack_run(packed: array) -> tuple[int, ...]:
    """The run of ids pack_run encoded."""
    return tuple(
        itertools.chain.from_iterable(
            itertools.repeat(packed[i], packed[i + 1]) for i in range(0, len(packed), 2)
        )
    )


def expansion_runs(ids: list[int], run_ids: frozenset[int]) -> list[tuple[int, ...]]:
    """The maximal runs of ids from run_ids (an image's expansion: its placeholder, row and end tokens), in order."""
    runs: list[list[int]] = []
    inside = False
    for t in ids:
        if t in run_ids:
            if not inside:
                runs.append([])
            runs[-1].append(t)
        inside = t in run_ids
    return [tuple(r) for r in runs]


class PlaceholderExpansion:
    """Per-size expansions learned from the processor, and the short way to build its outputs."""

    MAX_SIZES = (
        4096  # learned (image size, images in the prompt) keys kept, each ~0.3 KB (its run packed)
    )

    def __init__(
        self,
        tokenizer: Callable[[str], Any],
        image_token_id: int,
        run_ids: frozenset[int] = frozenset(),
    ) -> None:
        """run_ids: the ids besides the placeholder that an expansion holds (Pixtral's row and end tokens)."""
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id
        self.run_ids = frozenset(run_ids) | {image_token_id}
        self.verified: bool | None = None  # None: not yet compared with the processor
        self._expansions: dict[Key, array] = {}  # packed runs (pack_run), oldest learned first
        self._lock = threading.Lock()

    def expansions_for(self, sizes: list[Size]) -> list[tuple[int, ...]] | None:
        """Each image's run of ids, if the shortcut is on and every size was learned."""
        if not self.verified:
            return None
        packed = [self._expansions.get((*s, len(sizes))) for s in sizes]
        return None if None in packed else [unpack_run(p) for p in packed]

    def encode(
        self,
        text: str,
        expansions: list[tuple[int, ...]],
        image_outputs: Callable[[], dict[str, Any]],
    ) -> dict[str, Any] | None:
        """The processor's outputs built the short way: image_outputs() (the image processor's, run only once the
        ids fit) + expanded ids; None when the prompt's tokens do not hold exactly one placeholder per image."""
        ids = self.tokenizer(text).input_ids
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(expansions) or any(
            t in self.run_ids and t != self.image_token_id for t in ids
        ):
            return None
        expanded: list[int] = []
        start = 0
        for i, run in zip(at, expansions):
            expanded += ids[start:i]
            expanded += run
            start = i + 1
        expanded += ids[start:]
        input_ids = torch.tensor([expanded], dtype=torch.int64)
        return {
            **image_outputs(),
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
        }

    def learn(
        self,
        sizes: list[Size],
        enc: dict[str, Any],
        text: str,
        image_outputs: Callable[[], dict[str, Any]],
    ) -> None:
        """Record the expansions of a processor run (enc); the first time, check the short way reproduces enc."""
        if self.verified is False:
            return
        runs = expansion_runs(enc["input_ids"][0].tolist(), self.run_ids)
        if len(runs) != len(sizes):  # adjacent placeholders merged into one run: nothing to learn
            return
        with self._lock:
            for size, run in zip(sizes, runs):
                key = (*size, len(sizes))
                packed = pack_run(run)
                if self._expansions.setdefault(key, packed) != packed:
                    self._turn_off(
                        f"images of size {size} got two different expansions "
                        f"({len(unpack_run(self._expansions[key]))} and {len(run)} ids)"
                    )
                    return
            while len(self._expansions) > self.MAX_SIZES:
                self._expansions.pop(next(iter(self._expansions)))
            if self.verified is None:
                short = self.encode(text, runs, image_outputs)
                problem = _difference(enc, short)
                if problem:
                    self._turn_off(problem)
                else:
                    self.verified = True

    def _turn_off(self, why: str) -> None:
        self.verified = False
        self._expansions.clear()
        logger.info(
            "placeholder expansion shortcut off (%s); every image prompt runs the HF processor", why
        )


def _difference(enc: dict[str, Any], short: dict[str, Any] | None) -> str | None:
    """Why `short` does not equal the processor's outputs `enc` (None if it does)."""
    if short is None:
        return "the prompt's own tokens do not hold one placeholder per image"
    keys = set(enc.keys()) - UNUSED_KEYS
    if keys != set(short.keys()):
        return f"the processor returns {sorted(keys)}, the shortcut {sorted(short.keys())}"
    for key in keys:
        value, other = enc[key], short[key]
        if isinstance(value, torch.Tensor):
            same = (
                isinstance(other, torch.Tensor)
                and value.shape == other.shape
                and torch.equal(value.to(other.device), other)
            )
        else:
            same = value == other
        if not same:
            return f"{key!r} differs"
    return None


def placeholder_runs(ids: list[int], token_id: int, lengths: list[int]) -> list[int]:
    """Offsets of consecutive runs of token_id with the given lengths (in order); ValueError if they don't fit."""
    pos = [i for i, t in enumerate(ids) if t == token_id]
    if len(pos) != sum(lengths):
        raise ValueError(
            f"the prompt has {len(pos)} placeholder tokens but the media need {sum(lengths)}"
        )
    offsets, k = [], 0
    for n in lengths:
        run = pos[k : k + n]
        if run[-1] - run[0] != n - 1:
            raise ValueError("media placeholder tokens are not contiguous")
        offsets.append(run[0])
        k += n
    return offsets


def equal_runs(ids: list[int], token_id: int, num_items: int) -> list[tuple[int, int]]:
    """(offset, length) of num_items runs of token_id that all have the same length (LLaVA-1.5)."""
    if num_items == 0:
        return []
    total = sum(1 for t in ids if t == token_id)
    if total % num_items:
        raise ValueError(f"{total} image tokens cannot be split evenly over {num_items} images")
    n = total // num_items
    return [(off, n) for off in placeholder_runs(ids, token_id, [n] * num_items)]
