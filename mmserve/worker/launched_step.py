"""LaunchedStep: a launched step's queued device work, read back to the host only when asked, as the RunnerOutput
(core/step.py) that the engine takes from the runner."""

from __future__ import annotations

import time

import torch

from mmserve.core.step import RunnerOutput
from mmserve.worker.sampler import SamplerOutput


class LaunchedStep:
    """A step whose work is queued on the device.

    `tokens` (on the device) feeds the next step's placeholder inputs; `result()` waits only for this
    step's sampled values to reach the host (the copies are queued right behind the sampler).
    """

    def __init__(self, reqs: list, sampled: SamplerOutput | None, out: RunnerOutput) -> None:
        self.reqs = reqs
        self.out = out
        self.tokens = sampled.token_ids if sampled is not None else None
        self._host: list[torch.Tensor | None] | None = None
        self._event = None
        self.wait_s = 0.0  # how long result() blocked on the device
        if sampled is None:
            return
        fields = [sampled.token_ids]
        if sampled.logprobs is not None and any(r.params.logprobs is not None for r in reqs):
            fields += [sampled.logprobs, sampled.top_logprobs, sampled.top_token_ids, sampled.ranks]
        self._host = [t.to("cpu", non_blocking=True) if t is not None else None for t in fields]
        if sampled.token_ids.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> RunnerOutput:
        if self._host is None:
            return self.out
        if self._event is not None:
            t0 = time.perf_counter()
            self._event.synchronize()
            self.wait_s = time.perf_counter() - t0
        host, self._host = self._host, None
        token_ids = host[0].tolist()
        lp = top_lp = top_ids = ranks = None
        if len(host) > 1:
            lp, top_lp, top_ids = host[1].tolist(), host[2].tolist(), host[3].tolist()
            ranks = host[4].tolist() if host[4] is not None else None
        self.out.token_ids.update(zip([r.request_id for r in self.reqs], token_ids))
        if lp is None:
            return self.out
        for i, r in enumerate(self.reqs):
            rid = r.request_id
            if r.params.logprobs is not None:
                k = r.params.logprobs
                self.out.logprobs[rid] = lp[i]
                self.out.ranks[rid] = ranks[i] if ranks else None
                self.out.top_logprobs[rid] = list(zip(top_ids[i][:k], top_lp[i][:k]))
        return self.out
