"""Prompt logprobs (SamplingParams.prompt_logprobs = k): the log-probability of each prompt token given the
tokens before it, the rank of that token and the k likeliest ids, from the prompt positions' logits as the
runner computes them chunk by chunk (the log-softmax and top-k on the device; only [n] and [n, k] values cross
to the host). The model's raw distribution: no temperature, penalties or bias. The first prompt token has none.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mmserve.core.outputs import Logprob


class PromptLogprobs(NamedTuple):
    """For prompt tokens start + 1 .. start + n: their logprobs [n], ranks [n] and the top-k (ids, logprobs)."""

    start: int  # the chunk's first position; its row predicts token start + 1
    chosen: torch.Tensor  # [n] fp32
    ranks: torch.Tensor  # [n] int64, 1 = most likely
    top_ids: torch.Tensor  # [n, k] int64
    top_values: torch.Tensor  # [n, k] fp32


def chunk_logprobs(
    logits: torch.Tensor, prompt_ids: list[int], start: int, k: int
) -> PromptLogprobs:
    """logits [n, V] of prompt positions start .. start + n - 1 -> the logprobs of the prompt tokens they predict
    (the last prompt position predicts a generated token: no row for it)."""
    n = max(0, min(len(logits), len(prompt_ids) - 1 - start))
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    targets = torch.tensor(
        prompt_ids[start + 1 : start + 1 + n], dtype=torch.int64, device=logits.device
    )
    chosen = lp.gather(1, targets[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(dim=1) + 1
    top_values, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], targets[:, None][:, :0])
    return PromptLogprobs(start, chosen.cpu(), ranks.cpu(), top_ids.cpu(), top_values.cpu())


def entries(
    chunk: PromptLogprobs, prompt_ids: list[int], skip: int, decode
) -> list[dict[int, Logprob]]:
    """One {token id: Logprob} per prompt token of the chunk past its first `skip` rows: the prompt token first
    (with its rank), then the top-k ids (rank = place in the top-k), as generated tokens' logprobs are given."""
    out = []
    for r in range(skip, len(chunk.chosen)):
        tok = prompt_ids[chunk.start + 1 + r]
        entry = {tok: Logprob(float(chunk.chosen[r]), int(chunk.ranks[r]), decode([tok]))}
        for rank, (tid, value) in enumerate(
            zip(chunk.top_ids[r].tolist(), chunk.top_values[r].tolist()), start=1
        ):
            if tid != tok:
                entry[tid] = Logprob(value, rank, decode([tid]))
        out.append(entry)
    return out
