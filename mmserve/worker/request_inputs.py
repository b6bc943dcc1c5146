"""What a step's requests bring besides tokens: the rows of each LoRA adapter, and the cross-attention inputs of
families whose text attends encoder outputs (Mllama, encoder-decoders), both built by the runner per step."""
from __future__ import annotations

from collections.abc import Callable

import torch

from mmserve.attention.metadata import CrossAttentionBatch, CrossAttentionSeq
from mmserve.engine.request import MultiModalItem
from mmserve.worker.transfer import to_device


def lora_row_groups(computed: list, qsl: list[int], lora, device: torch.device) -> list:
    """(adapter, its rows of the flat batch) for each LoRA adapter the step's sequences use (`lora`: the engine's
    LoRAManager; sequence i owns rows qsl[i]..qsl[i + 1])."""
    rows: dict[str, list[int]] = {}
    for i, s in enumerate(computed):
        if s.request.lora is not None:
            rows.setdefault(s.request.lora, []).extend(range(qsl[i], qsl[i + 1]))
    return [(lora.get(name), to_device(r, torch.int64, device)) for name, r in rows.items()]


def cross_attention_batch(computed: list, qsl: list[int],
                          encode: Callable[[list[MultiModalItem]], dict[str, torch.Tensor]]) -> CrossAttentionBatch:
    """The step's sequences with media and what their cross-attention layers attend: the encoder's output per
    item (`encode`: by content hash, the encoder cache first), made on a request's first step and kept with the
    request so it lives exactly as long as the request."""
    with_media = [(i, s) for i, s in enumerate(computed) if s.request.mm_items]
    todo = [it for _, s in with_media if s.request.encoder_states is None for it in s.request.mm_items]
    encoded = encode(todo) if todo else {}
    seqs = []
    for i, s in with_media:
        req = s.request
        if req.encoder_states is None:
            req.encoder_states = [encoded[it.content_hash] for it in req.mm_items]
        seqs.append(CrossAttentionSeq(slice(qsl[i], qsl[i + 1]), s.start, req.num_prompt_tokens, req.mm_items,
                                      req.encoder_states))
    return CrossAttentionBatch(seqs)
