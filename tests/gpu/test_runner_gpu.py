"""GPU runner paths: CUDA-graph decode and the Triton backend give the same tokens as eager torch."""
from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, logprobs=3)


def _prompts(n: int) -> list[dict]:
    return [{"prompt": f"USER: {'<image>' * (i % 3)}\nquestion {i} " + "word " * i + "ASSISTANT:",
             "images": [make_test_image(i * 7 + k) for k in range(i % 3)]} for i in range(n)]


def _run(model_dir: str, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=8, **kw)
    outs = llm.generate(_prompts(12), PARAMS, use_tqdm=False)
    assert llm.engine.kv.usage == 0
    return [o.outputs[0].token_ids for o in outs], llm


def test_graphs_and_triton_match_eager_torch(tiny_llava_dir):
    reference, _ = _run(tiny_llava_dir, attention_backend="torch", enforce_eager=True)
    eager_triton, _ = _run(tiny_llava_dir, attention_backend="triton", enforce_eager=True)
    graphs, llm = _run(tiny_llava_dir, attention_backend="triton")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert eager_triton == reference
    assert graphs == reference


def test_half_precision_cuda_graphs_run(tiny_llava_dir):
    llm = LLM(tiny_llava_dir, device="cuda", dtype="float16", max_num_seqs=4, enable_prefix_caching=False)
    outs = llm.generate(_prompts(6), SamplingParams(max_tokens=16, temperature=0.8, seed=3), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    again = llm.generate(_prompts(6), SamplingParams(max_tokens=16, temperature=0.8, seed=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]


def test_async_scheduling_matches_sync_with_graphs(tiny_llava_dir):
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.0)] * 4
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(tiny_llava_dir, device="cuda", dtype="float32", max_num_seqs=8, async_scheduling=async_scheduling)
        outs = llm.generate(_prompts(12), params, use_tqdm=False)
        assert llm.engine.kv.usage == 0 and llm.engine.runner.graphs is not None
        runs.append(outs)
    # a request that stops is computed one step longer under async scheduling (its stop is read a step
    # late), which can change other rows' batch bucket: ids must match, log-probs up to kernel rounding
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    assert [o.outputs[0].text for o in runs[0]] == [o.outputs[0].text for o in runs[1]]
    for a, b in zip(runs[0], runs[1]):
        if a.outputs[0].cumulative_logprob is not None:
            assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-3)
