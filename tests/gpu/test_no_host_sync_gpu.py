"""Launching a step never makes the host wait for the GPU (async scheduling depends on it): CUDA's sync debug mode
raises on any synchronizing call (a pageable host-to-device copy, .item(), .tolist() of a device tensor) while the
runner queues steps that encode new images, mix them with decodes, and decode alone, for every family whose
encoder reads host-side sizes (LLaVA-NeXT's image sizes, Qwen2-VL's grids and M-RoPE positions)."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.bench.workload import PromptTemplate, image_size_of, make_images, make_prompt
from mmserve.testing import make_checkpoint

pytestmark = pytest.mark.gpu


def _requests(model_dir: str, n: int, seed: int) -> list[dict]:
    text = make_prompt(PromptTemplate(model_dir), 8).text
    return [
        {"prompt": text, "images": [im]}
        for im in make_images(n, image_size_of(model_dir), seed=seed)
    ]


def _run(llm: LLM, prompts: list[dict], params: SamplingParams, checked: bool) -> list[list[int]]:
    engine = llm.engine
    inputs = [
        engine.preprocess(p) for p in prompts
    ]  # preprocessing syncs its own stream: before the check
    for i, x in enumerate(inputs):
        engine.add_processed(f"r{checked}{i}", x, params)
    launch = engine.runner.launch
    kinds = set()

    def launch_checked(sched, *args, **kwargs):
        kinds.add(sched.kind)
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            return launch(sched, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    engine.runner.launch = launch_checked
    tokens: dict[str, list[int]] = {}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
    finally:
        engine.runner.launch = launch
    assert {"mixed", "decode"} <= kinds, kinds
    assert engine.kv.usage == 0
    return [tokens[f"r{checked}{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl"])
def test_steps_with_new_images_launch_without_host_sync(tmp_path, family):
    model_dir = str(make_checkpoint(family, tmp_path / family, preset="tiny"))
    llm = LLM(model_dir, device="cuda", dtype="float16", max_num_seqs=8, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # the first pass compiles kernels and times kernel choices (which synchronize); the second, with new pictures
    # (no encoder- or prefix-cache hits), is the one checked
    _run(llm, _requests(model_dir, 6, seed=1), params, checked=False)
    tokens = _run(llm, _requests(model_dir, 6, seed=2), params, checked=True)
    assert all(len(t) == 12 for t in tokens)
