"""The server process settles the garbage collector once its engine exists (entrypoints/serve.py): what exists is
frozen out of collections and the first generation collects far less often. Run in a child process, so the test
process keeps its own collector settings."""

from __future__ import annotations

import subprocess
import sys


def test_settle_garbage_collector_freezes_and_raises_the_threshold() -> None:
    code = (
        "import gc\n"
        "keep = [[i] for i in range(1000)]\n"
        "from mmserve.entrypoints.serve import GC_GEN0_THRESHOLD, settle_garbage_collector\n"
        "before = gc.get_threshold()\n"
        "settle_garbage_collector()\n"
        "print(gc.get_freeze_count() >= 1000, gc.get_threshold()[0] == GC_GEN0_THRESHOLD > before[0],\n"
        "      gc.get_threshold()[1:] == before[1:], 'torch' in __import__('sys').modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [
        "True",
        "True",
        "True",
        "False",
    ]  # frozen, raised, rest kept, and the CLI did not import torch
