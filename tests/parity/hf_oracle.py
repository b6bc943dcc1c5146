"""transformers as the oracle: greedy ids and per-step log-probs of any supported checkpoint for one prompt."""
from __future__ import annotations

import functools

import torch
import transformers
from transformers import AutoConfig, AutoProcessor


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, device: str):
    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    model = getattr(transformers, arch).from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def hf_greedy(model_dir: str, prompt: str, images: list | None, n: int, device: str = "cpu",
              videos: list | None = None, **processor_kwargs) -> tuple[list[int], list[int], torch.Tensor]:
    """Returns (prompt ids, n new greedy ids, [n, V] log-softmax of each step's scores).

    Scores are the logits after HF's processors, i.e. with EOS masked as min_new_tokens does; compare
    against mmserve run with min_tokens == max_tokens == n.
    """
    model, processor = _load(model_dir, device)
    enc = processor(text=prompt, images=images or None, videos=videos or None, return_tensors="pt",
                    **processor_kwargs).to(device)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    prompt_len = enc["input_ids"].shape[1]
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1).cpu()
    return enc["input_ids"][0].tolist(), out.sequences[0, prompt_len:].tolist(), logprobs
