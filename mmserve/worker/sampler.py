"""Batched token sampling: Sampler turns logits into one token per row following a SamplingBatch
(worker/sampling_batch.py: per-step tensors built from SamplingParams); the torch penalties and top-k / top-p /
min-p masks are in worker/sampling_filters.py.

Order of processing, per step, on fp32 copies of the logits [B, V] (steps 0-4 only for rows that need them):
  0. logit bias: the row's per-id values are added (OpenAI `logit_bias`, Triton `embedding_bias_*`); then guided
     decoding: ids the row's grammar matcher does not allow next get -inf (engine/guided.py);
  1. bad words: a bad word's last id gets -inf when its prefix (all ids but the last) equals the tail of
     the row's output ids (a one-token bad word always applies); the request's TokenSequenceMatcher
     (core/stop_matcher.py, fed its output ids as they arrive) has those ids ready, whatever the list's size;
  2. min_tokens: while len(output) < min_tokens, the row's EOS (unless ignore_eos) and stop_token_ids get -inf;
  3. penalties: repetition (HF: over prompt+output ids, logit>0 -> logit/p else logit*p), then presence and
     frequency (OpenAI: output ids only, logit -= presence*[count>0] + frequency*count);
  4. logprobs: log_softmax of the logits as they stand after 0-3, i.e. BEFORE temperature, top-k, top-p and
     min-p. Reported logprobs therefore describe the model's distribution under the request's hard
     constraints and penalties, and do not depend on the sampling knobs (the same choice as OpenAI's API);
  5. greedy rows (temperature == 0, or < 1e-5 to avoid overflow, or top_k == 1): argmax;
  6. other rows: logits / temperature, top-k, top-p (on the top-k-renormalised distribution), min-p
     (relative to the max prob), then an exact categorical draw by exponential race:
     argmax(probs / q), q ~ Exp(1) i.i.d. Rows with a seed draw q from their own torch.Generator (on the
     logits' device), so a seeded request's draws do not depend on the rest of the batch; others use the
     global RNG.
On CUDA, steps 5-6 are one Triton kernel (kernels/sampling.py: the same filters, a draw by inversion from
Philox noise, no sort; top-k's threshold from torch.topk), and when no row needs steps 1-4 it reads the
logits as they are, without the fp32 copy. Its noise comes from per-row seeds (SamplingBatch.seeds): a seeded
request's from its seed and output position, so its draws do not depend on the batch either; the others' from
one draw of torch's global (CPU) RNG per step.
Columns >= vocab_size (a padded lm_head) are never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampling_batch import SamplingBatch
from mmserve.worker.sampling_filters import apply_penalties, apply_top_k_top_p_min_p


def _allowed(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[G, W] int32 bits -> [G, width] bool (ids past the bitmask's vocabulary are not allowed)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, device=bitmask.device, dtype=torch.int32)) & 1
    allowed = bits.flatten(1).bool()
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    return torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)


@dataclass
class SamplerOutput:
    """One step's sampled ids, with their logprobs when a row asked for them."""

    token_ids: torch.Tensor  # [B] int64, the sampled ids
    logprobs: torch.Tensor | None = (
        None  # [B] fp32 logprob of the sampled id (None if no request asked)
    )
    top_logprobs: torch.Tensor | None = None  # [B, K] fp32, K = max requested logprobs, descending
    top_token_ids: torch.Tensor | None = None  # [B, K] int64
    ranks: torch.Tensor | None = None  # [B] int64 rank of the sampled id (1 = most likely)


class Sampler:
    """Stateless: turns logits [B, V] into one token per row following SamplingBatch (see module doc).

    fused: draw with the Triton kernel (None: on CUDA tensors)."""

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        as_is = (
            batch.mask_rows is None
            and batch.bias_rows is None
            and batch.guided_rows is None
            and not batch.has_penalties
            and batch.max_num_logprobs is None
        )
        if batch.all_greedy and as_is:
            # widening to fp32 is exact, so the argmax of the logits as they are is the same id, without a copy
            return SamplerOutput(token_ids=logits[:, : batch.vocab_size].argmax(dim=-1))
        fused = self.fused if self.fused is not None else logits.is_cuda
        if fused and as_is:
            return SamplerOutput(token_ids=self._fused_sample(logits, batch))
        logits = logits.to(torch.float32, copy=True)  # [B, V]
        if logits.shape[1] > batch.vocab_size:
            logits[:, batch.vocab_size :] = float("-inf")
        if batch.bias_rows is not None:
            logits.view(-1).index_add_(
                0, batch.bias_rows * logits.shape[1] + batch.bias_ids, batch.bias_values
            )
        if batch.guided_rows is not None:
            rows = logits.index_select(0, batch.guided_rows)
            rows.masked_fill_(~_allowed(batch.guided_bitmask, logits.shape[1]), float("-inf"))
            logits.index_copy_(0, batch.guided_rows, rows)
        if batch.mask_rows is not None:
            # not logits[rows, ids] = -inf: on CUDA that copies a CPU scalar to the device, and the pageable
            # copy waits for every queued kernel (a host sync per step for any request with min_tokens)
            flat = batch.mask_rows * logits.shape[1] + batch.mask_ids
            logits.view(-1).index_fill_(0, flat, float("-inf"))
        if batch.has_penalties:
            logits = apply_penalties(
                logits,
                batch.prompt_ids,
                batch.output_ids,
                batch.repetition_penalty,
                batch.presence_penalty,
                batch.frequency_penalty,
            )

        logprobs = (
            logits.log_softmax(dim=-1) if batch.max_num_logprobs is not None else None
        )  # [B, V]

        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        elif fused:
            token_ids = self._fused_sample(logits, batch)
        else:
            greedy_ids = logits.argmax(dim=-1) if batch.greedy is not None else None
            token_ids = self._sample(logits, batch)
            if greedy_ids is not None:
                token_ids = torch.where(batch.greedy, greedy_ids, token_ids)

        if logprobs is None:
            return SamplerOutput(token_ids=token_ids)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
        ranks = (logprobs > chosen).sum(dim=-1) + 1  # [B]
        top_vals, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)  # [B, K] each
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen.squeeze(1),
            top_logprobs=top_vals,
            top_token_ids=top_ids,
            ranks=ranks,
        )

    def warm_up(self, logits: torch.Tensor, vocab_size: int) -> None:
        """Compile what this sampler launches for `logits` (one row as the LM head returns it): on CUDA the fused
        kernel for the head's dtype and for fp32 logits (after penalties / masks / logprobs), one variant each
        for every mix of parameters; otherwise the first sampled step waits for the compile (0.7 s on an H100)."""
        sampled = dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
        for params in (
            SamplingParams(**sampled),
            SamplingParams(**sampled, repetition_penalty=1.1),
        ):
            batch = SamplingBatch.build(
                [params], [[0]], [[]], [None], [None], [[]], vocab_size, logits.device
            )
            self(logits.clone(), batch)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)

    @staticmethod
    def _fused_sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        from mmserve.kernels.sampling import sample

        assert batch.seeds is not None, (
            "the fused sampler draws from SamplingBatch.seeds, built for CUDA batches"
        )
        return sample(
            logits if logits.stride(1) == 1 else logits.contiguous(),
            batch.vocab_size,
            batch.seeds,
            batch.greedy,
            batch.temperature,
            batch.top_k,
            batch.max_top_k,
            batch.top_p,
            batch.min_p,
        )

    @staticmethod
    def _sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exact categorical draw per row; modifies `logits` in place. Greedy rows get a throwaway draw."""
        if batch.temperature is not None:
            logits.div_(batch.temperature.unsqueeze(1))
        if batch.top_k is not None or batch.top_p is not None or batch.min_p is not None:
            logits = apply_top_k_top_p_min_p(
                logits, batch.top_k, batch.top_p, batch.min_p, batch.max_top_k
            )
        probs = logits.softmax(dim=-1)  # [B, V]
        q = torch.empty_like(probs)  # [B, V] Exp(1) noise
        if batch.any_unseeded:
            q.exponential_()
        else:
            q.fill_(1.0)  # greedy rows only need finite noise
        for row, gen in batch.seeded:
            q[row].exponential_(generator=gen)
        # exponential_ may return exactly 0 on some backends; p / 0 would be inf (or nan for p = 0)
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)
