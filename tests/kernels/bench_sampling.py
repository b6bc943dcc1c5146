"""Sampler time per step: the fused Triton kernel vs the torch sampler, on bf16 logits (GPU only).

`PYTHONPATH=. python3 -m tests.kernels.bench_sampling`. Prints ms per call (CUDA events around eager calls,
as the runner calls it: outside CUDA graphs, launch overhead included) for Vicuna's and Qwen2's vocabulary
sizes at decode batch sizes, per mix of sampling parameters.
"""

from __future__ import annotations

import torch
import triton.testing

from mmserve.sampling_params import SamplingParams
from mmserve.worker.sampler import Sampler
from mmserve.worker.sampling_batch import SamplingBatch

MIXES = {
    "temperature 0.8": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "top-k 50 + top-p 0.95 + min-p 0.05": dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "top-p 0.9 + logprobs 5": dict(temperature=0.8, top_p=0.9, logprobs=5),
}


def main() -> None:
    device = torch.device("cuda")
    fused, unfused = Sampler(fused=True), Sampler(fused=False)
    print(f"{torch.cuda.get_device_name()}  bf16 logits, ms per sampler call")
    print(f"{'vocab':>7} {'batch':>5} {'mix':<36} {'torch':>7} {'fused':>7} {'speedup':>7}")
    for vocab in (32064, 152064):
        for rows in (1, 64, 256):
            gen = torch.Generator(device).manual_seed(rows)
            logits = (torch.randn(rows, vocab, device=device, generator=gen) * 3).to(torch.bfloat16)
            for name, kwargs in MIXES.items():
                params = [SamplingParams(**kwargs) for _ in range(rows)]
                batch = SamplingBatch.build(
                    params,
                    [[1]] * rows,
                    [[2]] * rows,
                    [None] * rows,
                    [None] * rows,
                    [[]] * rows,
                    vocab,
                    device,
                )
                t_torch = triton.testing.do_bench(lambda: unfused(logits, batch), rep=200)
                t_fused = triton.testing.do_bench(lambda: fused(logits, batch), rep=200)
                print(
                    f"{vocab:>7} {rows:>5} {name:<36} {t_torch:>7.3f} {t_fused:>7.3f} {t_torch / t_fused:>6.1f}x"
                )


if __name__ == "__main__":
    main()
