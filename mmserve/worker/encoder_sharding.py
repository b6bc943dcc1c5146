"""Vision encoders spread over the tensor-parallel ranks (`--mm-encoder-tp-mode data`).

By default the driver (rank 0) encodes every picture and the workers hold the language model alone. In data mode
every rank keeps a replica of the vision tower and projector. The items a step must encode (the encoder-cache
misses of `EncoderRunner.encode`) are split over the ranks by cost, their embedding rows, largest first onto the
least-loaded rank. The driver sends the workers an `EncodeShares` by pipe: the host layout of the items that are
not its own, as a step's `StepInputs` travels. It then broadcasts their floating inputs, as a step's tensors
travel. Every rank encodes its share (`EncoderRunner.encode_uncached`: equal shapes batched, encoder graphs), and
the flattened outputs are all-gathered (`tp_all_gather_varlen`), so that rank 0 has every item's embeddings, in
order, to cache and merge. Families whose text attends the encoder through cross-attention (Mllama, the
encoder-decoders) keep the driver's path: their encoder outputs feed per-rank key/value projections, not a merge.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mmserve.core.multimodal import MultiModalItem
from mmserve.distributed import get_tp_rank, tp_all_gather_varlen, tp_broadcast

if TYPE_CHECKING:
    from mmserve.worker.encoder_runner import EncoderRunner
    from mmserve.worker.tp_workers import TPWorkers

logger = logging.getLogger(__name__)


def encoders_split(model_config, model: torch.nn.Module) -> bool:
    """Whether this model's pictures are encoded over every tensor-parallel rank: `mm_encoder_tp_mode` data,
    more than one rank, and a family whose encoder output is merged into the prompt (self-attention)."""
    return (
        model_config.mm_encoder_tp_mode == "data"
        and model_config.tensor_parallel_size > 1
        and not model.family.cross_attention
    )


def attach_encoder_sharding(runner, tp_workers: TPWorkers | None, model_config) -> bool:
    """Give the driver's encoder its `EncoderSharding` when the model's encoders are split; log the choice.
    Returns whether they are."""
    if tp_workers is None or model_config.mm_encoder_tp_mode != "data":
        return False
    if not encoders_split(model_config, runner.model):
        logger.warning(
            "mm_encoder_tp_mode data: %s (attention %s) keeps its encoder on the driver: its encoder output "
            "feeds cross-attention keys/values, not a merge into the prompt",
            type(runner.model).__name__,
            runner.model.family.attention,
        )
        return False
    runner.encoder.sharding = EncoderSharding(tp_workers, model_config.tensor_parallel_size)
    logger.info(
        "mm_encoder_tp_mode data: every worker keeps the vision tower and projector; a step's new pictures are "
        "encoded over the %d ranks",
        model_config.tensor_parallel_size,
    )
    return True


def host_item(item: MultiModalItem | None) -> MultiModalItem | None:
    """`item` with its inputs on the host, to send by pipe (a CUDA tensor would travel by CUDA IPC)."""
    if item is None:
        return None
    return dataclasses.replace(item, data={k: v.cpu() for k, v in item.data.items()})


def assign_ranks(costs: list[int], size: int) -> list[int]:
    """Each item's rank: the largest first, each onto the least-loaded rank (ties: the lowest rank)."""
    loads = [0] * size
    ranks = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = min(range(size), key=lambda r: (loads[r], r))
        ranks[i] = rank
        loads[rank] += costs[i]
    return ranks


@dataclass
class ShareItem:
    """One item a worker encodes (or receives and passes over): its host inputs by pipe, its floating inputs'
    names and shapes, broadcast in this order in the model's dtype."""

    rank: int
    modality: str
    length: int
    host: dict[str, torch.Tensor]
    floats: list[tuple[str, tuple[int, ...]]]


@dataclass
class EncodeShares:
    """The host side of a step's spread encoding: the items of ranks 1..N-1, in the step's order."""

    items: list[ShareItem]


def _flat(outputs: list[torch.Tensor], encoder: EncoderRunner) -> torch.Tensor:
    if not outputs:
        return torch.empty(0, dtype=encoder.dtype, device=encoder.device)
    return torch.cat([o.reshape(-1).to(encoder.dtype) for o in outputs])


class EncoderSharding:
    """The driver's side: split a step's items, encode its own share, gather the others'."""

    def __init__(self, workers: TPWorkers, size: int) -> None:
        self.workers = workers
        self.size = size

    def encode(self, encoder: EncoderRunner, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """The embeddings [item.length, hidden] of `items`, in order, encoded over every rank."""
        ranks = assign_ranks([item.length for item in items], self.size)
        shares, tensors = [], []
        for item, rank in zip(items, ranks):
            if rank == 0:
                continue
            moved = encoder.on_device(item)
            floats = [(k, v) for k, v in sorted(moved.data.items()) if v.is_floating_point()]
            host = {k: v.cpu() for k, v in moved.data.items() if not v.is_floating_point()}
            shares.append(
                ShareItem(
                    rank, item.modality, item.length, host, [(k, tuple(v.shape)) for k, v in floats]
                )
            )
            tensors += [v for _, v in floats]
        self.workers.encode(EncodeShares(shares), tensors)
        own = encoder.encode_uncached([item for item, rank in zip(items, ranks) if rank == 0])
        gathered = tp_all_gather_varlen(_flat(own, encoder))
        out: list[torch.Tensor | None] = [None] * len(items)
        for i, emb in zip((i for i, r in enumerate(ranks) if r == 0), own):
            out[i] = emb
        for rank in range(1, self.size):
            mine = [i for i, r in enumerate(ranks) if r == rank]
            if not mine:
                continue
            flat = gathered[rank]
            width = flat.numel() // sum(items[i].length for i in mine)
            offset = 0
            for i in mine:
                n = items[i].length * width
                out[i] = flat[offset : offset + n].view(items[i].length, width)
                offset += n
        return out


def encode_mirrored(encoder: EncoderRunner, shares: EncodeShares) -> None:
    """A worker's side of `EncoderSharding.encode`: the broadcast inputs in, its own items encoded, every rank's
    outputs gathered (the driver keeps them)."""
    rank = get_tp_rank()
    mine = []
    for share in shares.items:
        data = dict(share.host)
        for name, shape in share.floats:
            data[name] = tp_broadcast(
                torch.empty(shape, dtype=encoder.dtype, device=encoder.device)
            )
        if share.rank == rank:
            mine.append(MultiModalItem(share.modality, data, 0, share.length, content_hash=""))
    tp_all_gather_varlen(_flat(encoder.encode_uncached(mine), encoder))
