"""What the shared tests need to know of a family, declared by the module that writes its checkpoints.

A family's module of :mod:`mmserve.testing` names them next to its writers, for the families it writes::

    TEST_CASES = {"fuyu": FamilyCase(prompt="What is number {} here?", image_size=(40, 30))}

and :func:`mmserve.testing.family_cases` collects them. A shared test takes the families whose case declares
the field it reads (and whose ``FamilySpec`` allows it); a family without a case is in none of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyCase:
    """Test facts of one family's tiny preset; ``None``: the tests that read the field leave the family out."""

    # a prompt of one picture in the family's own format, ``{}`` where each request writes its own number
    # (tests/unit/test_tensor_parallel_families.py)
    prompt: str | None = None
    # (width, height) of the pictures sent with ``prompt``; None: make_test_image's default size
    image_size: tuple[int, int] | None = None
    # the picture's placeholder as a prompt writes it, which the placeholder expansion shortcut expands
    # (tests/unit/test_placeholder_expansion.py)
    placeholder: str | None = None
    # `mmserve bench --family`'s --input-len: at least the prompt template's own tokens with the tiny BPE
    # (tests/unit/test_bench.py; against transformers where it has the family's architecture)
    bench_input_len: int | None = None
