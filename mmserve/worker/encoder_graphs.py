"""EncoderGraphs: CUDA graphs of a fixed-shape vision encoder, one per input shape and batch bucket.

An eager vision tower launches a few hundred small kernels per batch and is host-bound (a CLIP-L image:
~10 ms of launches for ~1 ms of GPU work). For families whose `get_mm_embeddings` has no host syncs
and no data-dependent shapes (`encoder_cuda_graphs = True`), the runner replays a graph instead. Graphs
are captured per (shapes, bucket) pair: at startup by `warm_up` for the checkpoint's usual image shape and
every bucket a step can need (a capture on first use cost that request 170-420 ms on an H100 for the first
bucket, ~30 ms for later ones), other pairs on first use. The batch is padded to the bucket with the
previous contents of the static input buffers (their outputs are never read). `vision_kernels` is the kernel
setting every vision-encoder run uses, in a graph or not.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mmserve.core.multimodal import MultiModalItem
from mmserve.kernels.graph_capture import graph_capture

logger = logging.getLogger(__name__)
# close together: padding images cost full encoder work (graphs are captured only for buckets in use)
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # name -> [bucket, *item shape]
    output: torch.Tensor  # [bucket, length, hidden]


class EncoderGraphs:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}

    @staticmethod
    def shape_key(item: MultiModalItem) -> tuple:
        return (item.modality, item.length) + tuple(
            (k, tuple(v.shape), v.dtype) for k, v in sorted(item.data.items())
        )

    @torch.inference_mode()
    def warm_up(self, template: MultiModalItem, max_items: int) -> None:
        """Capture the graphs of `template`'s shapes for every bucket up to the one holding max_items."""
        for bucket in BUCKETS[: bisect.bisect_left(BUCKETS, max_items) + 1]:
            self._captured(template, bucket)

    @torch.inference_mode()
    def encode(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Embeddings of `items` (same shape key, inputs already on the device in the right dtype)."""
        out: list[torch.Tensor] = []
        for start in range(0, len(items), BUCKETS[-1]):
            chunk = items[start : start + BUCKETS[-1]]
            bucket = BUCKETS[bisect.bisect_left(BUCKETS, len(chunk))]
            cap = self._captured(chunk[0], bucket)
            for name, buf in cap.inputs.items():
                for i, it in enumerate(chunk):
                    buf[i].copy_(it.data[name], non_blocking=True)
            cap.graph.replay()
            out += list(cap.output[: len(chunk)].clone())  # the next replay overwrites cap.output
        return out

    def _captured(self, template: MultiModalItem, bucket: int) -> _Captured:
        key = self.shape_key(template) + (bucket,)
        cap = self.graphs.get(key)
        if cap is not None:
            return cap
        t0 = time.perf_counter()
        inputs = {
            k: torch.zeros((bucket,) + tuple(v.shape), dtype=v.dtype, device=self.device)
            for k, v in template.data.items()
        }
        items = [
            MultiModalItem(
                template.modality,
                {k: buf[i] for k, buf in inputs.items()},
                0,
                template.length,
                f"graph-{i}",
            )
            for i in range(bucket)
        ]
        self.model.get_mm_embeddings(
            items
        )  # warm up (kernel selection, lazy init) outside the graph
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # captured while serving: preprocessing threads may be using the GPU on their own streams meanwhile,
        # so only this thread's calls are checked ("global" mode would fail their allocations and syncs)
        with graph_capture(graph, self.pool, capture_error_mode="thread_local"):
            output = torch.stack(self.model.get_mm_embeddings(items))
        cap = self.graphs[key] = _Captured(graph, inputs, output)
        logger.info(
            "captured the vision encoder's graph for %d items of %s in %.0f ms",
            bucket,
            self.shape_key(template),
            (time.perf_counter() - t0) * 1000,
        )
        return cap


# cuDNN attention, PyTorch's first choice on Hopper, spends ~0.4 ms of host time per call, which makes an
# eager vision tower host-bound (about 10 ms for one CLIP-L image); flash / memory-efficient launch in µs
_VISION_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def vision_kernels(dtype: torch.dtype) -> Iterator[None]:
    """The kernel settings every vision-encoder run (eager, or captured into a graph) uses: flash /
    memory-efficient attention (_VISION_SDPA) and, for an fp32 model, exact fp32 convolutions."""
    with sdpa_kernel(_VISION_SDPA), _exact_fp32_convolutions(dtype == torch.float32):
        yield


@contextlib.contextmanager
def _exact_fp32_convolutions(enabled: bool):
    """cuDNN runs fp32 convolutions in TF32 by default and picks its algorithm per batch size, so an fp32
    model's patch embeddings would depend on how many images share a step; fp32 means fp32 here."""
    if not enabled:
        yield
        return
    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = previous
