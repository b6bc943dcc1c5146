"""The end of a launched step: the logits of the rows that sample, the queued sampling, prompt-end hidden
states kept for the PromptEndCache, and the prompt positions' logits / logprobs requests asked for."""

from __future__ import annotations

import torch
from torch import nn

from mmserve.core.step import RunnerOutput
from mmserve.core.transfer import to_device
from mmserve.worker.launched_step import LaunchedStep
from mmserve.worker.prompt_logprobs import chunk_logprobs
from mmserve.worker.sampler import Sampler
from mmserve.worker.sampling_batch import SamplingBatch
from mmserve.worker.step_batch import FlatBatch


class StepSampling:
    """Samples a step's tokens on the device (queued, not waited for) from its logits or hidden states."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.sampler = Sampler()
        self.prompt_ends: torch.Tensor | None = (
            None  # [slots, H] final hidden states (PromptEndCache)
        )

    def finish(
        self,
        batch: FlatBatch,
        logits: torch.Tensor | None,
        hidden: torch.Tensor,
        loads: list,
        loaded: torch.Tensor | None,
    ) -> LaunchedStep:
        """Sample the step from its logits (a row per token; None: from the hidden state of each sampling
        sequence's last token); prompt-end loads sample last, from `loaded`."""
        self._store_prompt_ends(batch, hidden)
        reqs = [batch.seqs[i].request for i in batch.sampling] + [s.request for s in loads]
        chunks = []
        if batch.sampling and logits is None:
            rows = to_device(
                [batch.qsl[i + 1] - 1 for i in batch.sampling], torch.int64, self.device
            )
            chunks.append(self.model.compute_logits(hidden[rows]))
        elif batch.sampling:
            contiguous = batch.sampling == list(range(len(batch.sampling)))
            chunks.append(
                logits[: len(batch.sampling)]
                if contiguous
                else logits[to_device(batch.sampling, torch.int64, self.device)]
            )
        if loaded is not None:
            chunks.append(self.model.compute_logits(loaded))
        step = self.sample(
            reqs, torch.cat(chunks) if len(chunks) > 1 else chunks[0] if chunks else None
        )
        self._context_logits(batch, step.out, hidden=hidden, logits=logits)
        return step

    def sample(self, reqs: list, logits: torch.Tensor | None) -> LaunchedStep:
        """logits [B, V] of the requests that sample this step -> their new tokens (queued)."""
        if not reqs:
            return LaunchedStep([], None, RunnerOutput())
        if all(
            r.grammar is None and len(r.output_token_ids) >= r.plain_sampling_from for r in reqs
        ):  # plain_greedy, the common batch: none of the per-row lists below
            batch = SamplingBatch.plain(len(reqs), logits.shape[-1], self.device)
        else:
            batch = self._batch(reqs, logits.shape[-1])
        out = RunnerOutput()
        if any(r.params.return_generation_logits for r in reqs):
            for i, r in enumerate(reqs):
                if r.params.return_generation_logits:
                    out.generation_logits[r.request_id] = logits[i].float().cpu()
        return LaunchedStep(reqs, self.sampler(logits, batch), out)

    def _batch(self, reqs: list, vocab_size: int) -> SamplingBatch:
        """SamplingBatch.build from each request's state."""
        return SamplingBatch.build(
            [r.params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.generator for r in reqs],
            [r.eos_token_ids for r in reqs],
            [r.bad_words for r in reqs],
            vocab_size,
            self.device,
            grammars=[r.grammar for r in reqs],
        )

    def _store_prompt_ends(self, batch: FlatBatch, hidden: torch.Tensor) -> None:
        """Keep the final hidden state of each prompt this step completes in its prompt-end slot (request i's
        rows of `hidden` end at qsl[i + 1]); only prompt chunks complete a prompt."""
        computed, qsl = batch.seqs, batch.qsl
        stores = [
            (i, computed[i].store_prompt_end)
            for i in batch.prompt_chunks
            if computed[i].store_prompt_end is not None
        ]
        if not stores:
            return
        rows = [qsl[i + 1] - 1 for i, _ in stores]
        dev = self.device
        self.prompt_ends[to_device([slot for _, slot in stores], torch.int64, dev)] = hidden[
            to_device(rows, torch.int64, dev)
        ].to(self.prompt_ends.dtype)

    def _context_logits(
        self,
        batch: FlatBatch,
        out: RunnerOutput,
        hidden: torch.Tensor | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """Logits of this step's prompt positions for requests with return_context_logits, and the prompt tokens'
        logprobs for those with prompt_logprobs (from the hidden states, or from the step's logits when every row
        already has them)."""
        qsl = batch.qsl
        for i in batch.prompt_chunks:
            s = batch.seqs[i]
            req = s.request
            end = min(s.end, req.num_prompt_tokens)
            if not req.params.needs_prompt_logits or s.start >= end:
                continue
            rows = slice(qsl[i], qsl[i] + end - s.start)
            chunk = logits[rows] if logits is not None else self.model.compute_logits(hidden[rows])
            if req.params.return_context_logits:
                out.context_logits[req.request_id] = (s.start, chunk.float().cpu())
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs[req.request_id] = chunk_logprobs(
                    chunk, req.prompt_token_ids, s.start, req.params.prompt_logprobs
                )
