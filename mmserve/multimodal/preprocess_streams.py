"""PreprocessStreams: HF processor calls on the calling thread's own CUDA stream when preprocessing runs on
the GPU, so they never queue behind the engine's steps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class PreprocessStreams:
    """One CUDA stream per preprocessing thread on `device` (None: preprocessing on the CPU, no streams)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        self._local = threading.local()

    def run(self, fn: Callable[[], Any]) -> Any:
        """fn() (an HF processor call) on this thread's own CUDA stream when preprocessing runs on the GPU.
        Its uploads from pageable memory synchronize their stream; on the engine's stream they would wait
        behind every step already queued there (with async scheduling, always one), stalling each request's
        preprocessing by a step."""
        if self.device is None:
            return fn()
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            enc = fn()
            for key, value in list(
                enc.items()
            ):  # sizes and grids to the host here, not later on the engine's
                if (
                    isinstance(value, torch.Tensor)
                    and value.is_cuda
                    and not value.is_floating_point()
                ):
                    enc[key] = value.cpu()  # waits for this thread's stream only
        stream.synchronize()
        engine_stream = torch.cuda.default_stream(self.device)
        for value in enc.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                value.record_stream(engine_stream)  # freed only after the engine's reads of it
        return enc
