"""What a step's requests bring besides tokens: the rows of each LoRA adapter, and the cross-attention inputs of
families whose text attends encoder outputs (Mllama, encoder-decoders), both built by the runner per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from mmserve.attention.metadata import AttentionMetadata, CrossAttentionBatch, CrossAttentionSeq
from mmserve.core.multimodal import MultiModalItem
from mmserve.core.transfer import cdiv, to_device
from mmserve.worker.cross_kv import CrossKVPool


def lora_rows(computed: list, qsl: list[int]) -> dict[str, list[int]]:
    """Rows of the flat batch by the LoRA adapter their sequence uses (sequence i owns rows qsl[i]..qsl[i + 1])."""
    rows: dict[str, list[int]] = {}
    for i, s in enumerate(computed):
        if s.request.lora is not None:
            rows.setdefault(s.request.lora, []).extend(range(qsl[i], qsl[i + 1]))
    return rows


def media_rows(computed: list, qsl: list[int], rule: str) -> list[int]:
    """Rows of the flat batch that are picture tokens by the family's `media_rows` rule ("span": a picture's whole
    placeholder run; "span_but_last": all of it but its last token), from each item's span and the chunk scheduled,
    never from the chunk's edges: a chunk cut anywhere gives the rows an uncut prompt would."""
    rows: list[int] = []
    trim = 1 if rule == "span_but_last" else 0
    for i, s in enumerate(computed):
        start, stop = s.start, s.start + s.num_tokens
        for item in s.request.mm_items:
            lo, hi = max(item.offset, start), min(item.offset + item.length - trim, stop)
            rows.extend(range(qsl[i] + lo - start, qsl[i] + hi - start))
    return rows


def media_lora_rows(
    computed: list, qsl: list[int], rule: str, builtin: str | None
) -> dict[str, list[int]]:
    """A `media_lora` family's LoRA rows: each sequence's picture rows (`media_rows`), by its own adapter, else by
    the model's built-in one (`builtin`: its name, None for none)."""
    rows: dict[str, list[int]] = {}
    for i, s in enumerate(computed):
        name = s.request.lora or builtin
        if name is not None:
            picture = media_rows([s], [qsl[i], qsl[i + 1]], rule)
            if picture:
                rows.setdefault(name, []).extend(picture)
    return rows


def lora_row_groups(rows: dict[str, list[int]], lora, device: torch.device) -> list:
    """(adapter, its rows on the device) for each adapter of `rows` (lora_rows; `lora`: a LoRAManager)."""
    return [(lora.get(name), to_device(r, torch.int64, device)) for name, r in rows.items()]


@dataclass
class CrossStepHost:
    """A step's cross-attention inputs as host values, the layout its CrossAttentionBatch is built from
    (`cross_batch`): on the driver, and, sent by pipe (`for_workers`), on each tensor-parallel worker (worker/
    tp_mirror.py) with the pool writes (the encoder outputs written travel beside this, by broadcast)."""

    writes: list[list[int]] = field(
        default_factory=list
    )  # pool blocks of each encoder output written
    # per sequence: (rows start, rows stop, start, prompt_len, items, pool blocks | None, pool order | None,
    # encoder tokens)
    seqs: list[tuple] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_lens: list[int] = field(default_factory=list)

    def for_workers(self, model) -> CrossStepHost:
        """This layout as a worker gets it: items without their pixels (`model.cross_item_layout`), orders as
        lists (a tensor would cross the pipe through shared memory)."""
        seqs = [
            (
                *s[:4],
                [model.cross_item_layout(it) for it in s[4]],
                s[5],
                None if s[6] is None else s[6].tolist(),
                s[7],
            )
            for s in self.seqs
        ]
        return replace(self, seqs=seqs)


def cross_attention_batch(
    computed: list,
    qsl: list[int],
    encode: Callable[[list[MultiModalItem]], dict[str, torch.Tensor]],
    model,
    pool: CrossKVPool,
    backend,
    encode_batch: int,
    mirror: bool = False,
) -> tuple[CrossAttentionBatch, CrossStepHost, list[torch.Tensor]]:
    """The step's sequences with media and where their encoder keys/values are: a request's items are encoded
    (`encode`: by content hash, the encoder cache first; about encode_batch items at a time, so a step that
    admits many requests stays within the activation profile) on its first step after admission and written to
    its blocks of the cross-attention pool, in the order `model.cross_kv_order` gives. The leading sequences
    that hold one generated token each are the batch's decodes (the scheduler puts decodes first). Returns the
    batch, its host layout and, with `mirror`, the encoder outputs written, in pool order (else [])."""
    host = CrossStepHost()
    written = []
    with_media = [(i, s) for i, s in enumerate(computed) if s.request.mm_items]
    todo = [s.request for _, s in with_media if not s.request.cross_kv_written]
    while todo:
        group = [todo.pop(0)]
        while todo and len(todo[0].mm_items) + sum(len(r.mm_items) for r in group) <= encode_batch:
            group.append(todo.pop(0))
        encoded = encode([it for r in group for it in r.mm_items])
        for req in group:
            states = _write_cross_kv(req, encoded, model, pool)
            if mirror:
                host.writes.append(req.cross_block_ids)
                written.append(states)
        del encoded
    for i, s in with_media:
        req = s.request
        if (
            len(host.decode_lens) == len(host.seqs)
            and s.num_tokens == 1
            and s.start >= req.num_prompt_tokens
        ):
            host.decode_tables.append(req.cross_block_ids)  # attends through decode_meta
            host.decode_lens.append(req.cross_decode_len)
            blocks, order = None, None
        else:
            blocks, order = req.cross_block_ids, req.cross_kv_order
        host.seqs.append(
            (
                qsl[i],
                qsl[i + 1],
                s.start,
                req.num_prompt_tokens,
                req.mm_items,
                blocks,
                order,
                req.cross_kv_tokens,
            )
        )
    return cross_batch(host, pool, backend), host, written


def cross_batch(host: CrossStepHost, pool: CrossKVPool, backend) -> CrossAttentionBatch:
    """The step's CrossAttentionBatch over `pool` from its host layout."""
    dev = pool.storage.device
    seqs = []
    for start_row, stop_row, start, prompt_len, items, blocks, order, tokens in host.seqs:
        seq = CrossAttentionSeq(slice(start_row, stop_row), start, prompt_len, items, None, tokens)
        if blocks is not None:
            seq.block_table = to_device(blocks, torch.int64, dev)
            seq.order = None if order is None else to_device(order, torch.int64, dev)
        seqs.append(seq)
    batch = CrossAttentionBatch(seqs, pool.caches, len(host.decode_lens), None, backend)
    if host.decode_lens:
        batch.decode_meta = decode_metadata(
            host.decode_tables, host.decode_lens, pool.block_size, dev
        )
    return batch


def cross_batch_from_host(
    host: CrossStepHost, written: list[torch.Tensor], model, pool: CrossKVPool, backend
) -> CrossAttentionBatch:
    """A tensor-parallel worker's copy of the driver's step (cross_attention_batch with mirror): write the
    broadcast encoder outputs' keys/values (this rank's heads) to their pool blocks, then the same batch."""
    for blocks, states in zip(host.writes, written):
        pool.write(model.cross_kv(states), blocks)
    return cross_batch(host, pool, backend)


def cross_decode_inputs(
    computed: list, max_blocks: int, block_size: int
) -> tuple[list[list[int]], list[int]] | None:
    """For a decode graph of a cross-attention family: each sequence's pool blocks its generated token attends
    and their token count, or None when a step cannot replay one (a sequence without media, a prompt chunk, one
    whose encoder output is not in the pool yet, or more than max_blocks blocks)."""
    tables, lens = [], []
    for s in computed:
        req = s.request
        n = cdiv(req.cross_decode_len, block_size)
        if (
            not req.mm_items
            or not req.cross_kv_written
            or s.start < req.num_prompt_tokens
            or n > max_blocks
        ):
            return None
        tables.append(req.cross_block_ids[:n])
        lens.append(req.cross_decode_len)
    return tables, lens


def _write_cross_kv(
    req, encoded: dict[str, torch.Tensor], model, pool: CrossKVPool
) -> torch.Tensor:
    """Write the keys/values of req's encoder outputs (by content hash in `encoded`) to its pool blocks in the
    family's order; returns those outputs in that order."""
    states = [encoded[it.content_hash] for it in req.mm_items]
    states = states[0] if len(states) == 1 else torch.cat(states)
    req.cross_kv_order, decode_len = model.cross_kv_order(req.mm_items, req.num_prompt_tokens)
    if req.cross_kv_order is not None:
        states = states[req.cross_kv_order.to(states.device)]
    pool.write(model.cross_kv(states), req.cross_block_ids)
    req.cross_kv_written, req.cross_kv_tokens, req.cross_decode_len = True, len(states), decode_len
    return states


def decode_metadata(
    block_tables: list[list[int]], seq_lens: list[int], block_size: int, device: torch.device
) -> AttentionMetadata:
    """AttentionMetadata of one query per sequence over the first seq_lens[i] tokens of block_tables[i]."""
    width = max(len(t) for t in block_tables)
    n = len(seq_lens)
    return AttentionMetadata(
        query_start_loc=to_device(list(range(n + 1)), torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_tables=to_device(
            [t + [0] * (width - len(t)) for t in block_tables], torch.int32, device
        ),
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=list(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        num_decodes=n,
    )
