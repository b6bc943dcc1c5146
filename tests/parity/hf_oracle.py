"""transformers as the oracle: greedy ids and per-step log-probs of any supported checkpoint for one prompt,
and the parity tests' shared checks of mmserve's outputs against it."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import transformers
from transformers import AutoConfig, AutoProcessor

from mmserve import LLM, SamplingParams
from mmserve.core.outputs import RequestOutput
from mmserve.engine.engine import Engine

# log-prob tolerance against the fp32 oracle: GPU kernels sum in another order than transformers on the CPU
TOL = {"cpu": 2e-3, "cuda": 1e-2}


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, device: str):
    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    model = (
        getattr(transformers, arch)
        .from_pretrained(model_dir, dtype=torch.float32)
        .to(device)
        .eval()
    )
    projection = getattr(getattr(model, "model", model), "image_to_text_projection", None)
    if projection is not None and getattr(projection.x_attn, "is_causal", False):
        # transformers 5.17's Kosmos-2 marks the latent queries' attention causal, which SDPA applies when no mask
        # is given; the model's (and later versions') latent queries see every image state and each other
        projection.x_attn.is_causal = False
    return model, AutoProcessor.from_pretrained(model_dir)


def text_only_generator(model: torch.nn.Module) -> torch.nn.Module:
    """The module that generates for a prompt without pictures: Kosmos-2's text model alone (transformers 5.17's
    Kosmos2ForConditionalGeneration.generate wants pixel_values; later ones run that decoder alone), else ``model``."""
    return getattr(model, "text_model", model)


def hf_greedy(
    model_dir: str,
    prompt: str,
    images: list | None,
    n: int,
    device: str = "cpu",
    videos: list | None = None,
    **processor_kwargs,
) -> tuple[list[int], list[int], torch.Tensor]:
    """Returns (prompt ids, n new greedy ids, [n, V] log-softmax of each step's scores).

    Scores are the logits after HF's processors, i.e. with EOS masked as min_new_tokens does; compare
    against mmserve run with min_tokens == max_tokens == n.
    """
    model, processor = _load(model_dir, device)
    if device != "cpu" and (images or videos):
        # mmserve resizes/normalises on the GPU when it serves there; the oracle does the same, so the
        # comparison is of the models, not of CPU vs GPU interpolation
        processor_kwargs.setdefault("device", device)
    enc = processor(
        text=prompt,
        images=images or None,
        videos=videos or None,
        return_tensors="pt",
        **processor_kwargs,
    ).to(device)
    if not images and not videos:
        model = text_only_generator(model)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    prompt_len = enc["input_ids"].shape[1]
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1).cpu()
    return enc["input_ids"][0].tolist(), out.sequences[0, prompt_len:].tolist(), logprobs


def hf_logits(
    model_dir: str,
    prompt: dict,
    n: int,
    device: str = "cpu",
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(context logits [T, V], logits of n greedy steps [n, V]) of a freshly loaded fp32 transformers model
    for an mmserve prompt dict; `prepare(model)` may patch the model first (it is not the cached one)."""
    arch = AutoConfig.from_pretrained(model_dir).architectures[0]
    model = (
        getattr(transformers, arch)
        .from_pretrained(model_dir, dtype=torch.float32)
        .to(device)
        .eval()
    )
    if prepare is not None:
        prepare(model)
    processor = AutoProcessor.from_pretrained(model_dir)
    kw = {"device": device} if device != "cpu" else {}
    enc = processor(
        text=prompt["prompt"], images=prompt.get("images"), return_tensors="pt", **kw
    ).to(device)
    with torch.no_grad():
        context = model(**enc, use_cache=True).logits[0].float().cpu()  # K/V pass through the cache
        gen = model.generate(
            **enc,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return context, torch.stack(gen.logits)[:, 0].float().cpu()


def assert_matches_oracle(
    out: RequestOutput, oracle: tuple[list[int], list[int], torch.Tensor], tol: float = 2e-3
) -> None:
    """``out`` has the oracle's prompt ids and greedy ids, and the log-prob of every token it reports
    (the chosen and the top-k) is within ``tol`` of the oracle's at every step.

    ``oracle`` is (prompt ids, greedy ids, [n, V] log-probs), as :func:`hf_greedy` returns.
    """
    prompt_ids, ref_ids, ref_lp = oracle
    assert out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == ref_ids
    for step, entry in enumerate(out.outputs[0].logprobs):
        for tok, lp in entry.items():
            ref = ref_lp[step, tok].item()
            assert abs(lp.logprob - ref) < tol, (
                f"step {step}, token {tok}: {lp.logprob:.6f} vs oracle {ref:.6f}"
            )


def check_against_hf(
    model_dir: str,
    prompt: dict,
    out: RequestOutput,
    n: int,
    device: str = "cpu",
    videos: list | None = None,
    tol: float | None = None,
) -> None:
    """Run the oracle on ``prompt`` (an mmserve prompt dict: "prompt", optional "images" / "videos") for
    ``n`` tokens and :func:`assert_matches_oracle`. ``videos``: the decoded frames HF should see
    (default: the prompt's own "videos", e.g. when the prompt gives encoded bytes). ``tol`` defaults to
    2e-3 on CPU and 1e-2 on GPU, whose kernels sum in a different order than the oracle's."""
    videos = videos if videos is not None else prompt.get("videos")
    oracle = hf_greedy(model_dir, prompt["prompt"], prompt.get("images"), n, device, videos=videos)
    assert_matches_oracle(out, oracle, tol if tol is not None else TOL[device])


def run_staggered(engine: Engine, prompts: list, params: SamplingParams) -> list[RequestOutput]:
    """Add one prompt to the running batch per engine step (request ids "0", "1", ...) and step until all
    have finished; the final outputs in prompt order."""
    done: dict[str, RequestOutput] = {}
    step = 0
    while len(done) < len(prompts):
        if step < len(prompts):  # one new request joins the running batch each step
            engine.add_request(str(step), prompts[step], params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return [done[str(i)] for i in range(len(prompts))]


def assert_two_shards_match_one(
    model_dir: str, prompts: list, device: str = "cpu", **engine_kw: object
) -> None:
    """Two tensor-parallel shards (a real worker process: gloo on the CPU, NCCL on two GPUs) give one process's
    greedy tokens of `prompts` and their log-probs within 1e-4 (2e-3 on GPUs, whose kernels sum the split
    features in another order). `engine_kw`: more LLM arguments for both engines."""
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, logprobs=2)
    kw = dict(device=device, dtype="float32", **engine_kw)
    single = LLM(model_dir, **kw).generate(prompts, params, use_tqdm=False)
    tp = LLM(model_dir, tensor_parallel_size=2, **kw)
    try:
        sharded = tp.generate(prompts, params, use_tqdm=False)
    finally:
        tp.close()
    tol = 1e-4 if device == "cpu" else 2e-3
    for a, b in zip(single, sharded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in x:
                assert abs(x[tok].logprob - y[tok].logprob) < tol
