"""Vision encoders spread over the tensor-parallel ranks (`mm_encoder_tp_mode="data"`; CPU, gloo, a real worker
process; also on two GPUs with `-m gpu`): two shards give one process's greedy tokens and log-probs for batches
with several pictures per request, Qwen2-VL's of different patch counts, with encoder-cache hits mixed in; each
rank encodes a share (its tower's item counter, read back through `TPWorkers.call`) and the worker keeps the vision
tower; a cross-attention family (Mllama) keeps the driver's path; items are balanced by their embedding rows."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import ModelConfig
from mmserve.testing import make_checkpoint, make_test_image
from mmserve.worker.encoder_sharding import assign_ranks

N = 6
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=2)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
        ],
    ),
]
QWEN_TAG = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2-VL's patch grid follows the picture's size: these give items of different lengths
QWEN_SIZES = [(56, 84), (84, 56), (112, 84), (56, 56), (140, 112)]


def _llava_prompt(text: str, seeds: list[int]) -> dict:
    tags = "".join("<image>\n" for _ in seeds)
    return {
        "prompt": f"USER: {tags}{text} ASSISTANT:",
        "images": [make_test_image(s) for s in seeds],
    }


def _qwen_prompt(text: str, seeds: list[int]) -> dict:
    return {
        "prompt": f"<|im_start|>user\n{QWEN_TAG * len(seeds)}{text}<|im_end|>\n<|im_start|>assistant\n",
        "images": [make_test_image(s, QWEN_SIZES[s % len(QWEN_SIZES)]) for s in seeds],
    }


def _batches(family: str) -> list[list[dict]]:
    """Two rounds: the second repeats pictures of the first (encoder-cache hits) beside new ones, in prompts
    whose text comes first (no prefix-cache hit covers them)."""
    make = _llava_prompt if family == "llava" else _qwen_prompt
    first = [make(f"what is in {i}?", [3 * i + k for k in range(1 + i % 3)]) for i in range(4)]
    second = [make(f"and now {i}, tell me", [2, 40 + i, 0]) for i in range(2)]
    return [first, second]


def _generate(llm: LLM, batches: list[list[dict]]) -> list:
    return [out for batch in batches for out in llm.generate(batch, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_each_rank_encodes_a_share_and_tokens_match_one_process(family, tmp_path, device):
    model_dir = str(make_checkpoint(family, tmp_path / family, preset="tiny", seed=0))
    batches = _batches(family)
    # 40-token steps: prompts are chunked through their pictures (a later chunk reads the encoder cache)
    kw = dict(device=device, dtype="float32", max_num_seqs=4, max_num_batched_tokens=40)
    with LLM(model_dir, tensor_parallel_size=2, mm_encoder_tp_mode="data", **kw) as llm:
        engine = llm.engine
        assert engine.runner.encoder.sharding is not None
        lm = engine.model.language_model
        lm_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
        (worker_bytes,) = engine.tp_workers.call("weight_bytes")()
        assert worker_bytes > lm_bytes  # the worker kept the vision tower and projector
        two = _generate(llm, batches)
        here = engine.runner.items_encoded()
        (there,) = engine.tp_workers.call("items_encoded")()
        hits = engine.runner.encoder.cache.hit_rate
    one_llm = LLM(model_dir, **kw)
    one = _generate(one_llm, batches)
    total = one_llm.engine.runner.items_encoded()
    # every new picture was encoded once, by one of the two ranks, and each rank took a share; the repeated
    # pictures came from the driver's encoder cache
    pictures = sum(len(p["images"]) for batch in batches for p in batch)
    assert here + there == total < pictures and here > 0 and there > 0
    assert hits > 0
    tol = 1e-4 if device == "cpu" else 2e-3
    for a, b in zip(two, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in lb.items():
                assert math.isclose(la[tok].logprob, lp.logprob, abs_tol=tol)


def test_a_cross_attention_family_keeps_the_driver_path(tmp_path, caplog):
    model_dir = str(make_checkpoint("mllama", tmp_path / "mllama", preset="tiny", seed=0))
    prompt = {"prompt": "<|image|>what is this?", "images": [make_test_image(5)]}
    kw = dict(device="cpu", dtype="float32", max_num_seqs=2)
    with caplog.at_level(logging.WARNING, logger="mmserve.worker.encoder_sharding"):
        with LLM(model_dir, tensor_parallel_size=2, mm_encoder_tp_mode="data", **kw) as llm:
            engine = llm.engine
            assert engine.runner.encoder.sharding is None
            lm = engine.model.language_model
            lm_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
            (worker_bytes,) = engine.tp_workers.call("weight_bytes")()
            two = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            (there,) = engine.tp_workers.call("items_encoded")()
            here = engine.runner.items_encoded()
    assert "keeps its encoder on the driver" in caplog.text
    assert worker_bytes == lm_bytes and there == 0 and here == 1  # the worker dropped its encoder
    one = LLM(model_dir, **kw).generate([prompt], GREEDY, use_tqdm=False)[0]
    assert two.outputs[0].token_ids == one.outputs[0].token_ids


def test_items_are_balanced_by_their_rows():
    assert assign_ranks([100, 10, 10, 90], 2) == [0, 1, 0, 1]  # 110 and 100 rows
    assert assign_ranks([5, 5, 5], 2) == [0, 1, 0]
    assert assign_ranks([7], 4) == [0]
    assert assign_ranks([], 2) == []
    assert assign_ranks([30, 20, 20, 10, 10, 10], 3) == [0, 1, 2, 1, 2, 0]  # 40, 30, 30 rows


def test_the_mode_is_checked():
    with pytest.raises(ValueError, match="mm_encoder_tp_mode"):
        ModelConfig("m", mm_encoder_tp_mode="weights")


def test_latency_bench_times_a_request_with_several_pictures_over_two_ranks(tmp_path):
    """The issue's measurement on the CPU: `mmserve bench latency` with three pictures per request, two shards
    and the encoders split, recorded in the JSON."""
    from mmserve.bench.cli import main
    from mmserve.bench.latency import LatencyConfig
    from mmserve.bench.workload import ModelSource

    def run(n: int, mode: str) -> dict:
        out = tmp_path / f"{n}-{mode}.json"
        args = ["latency", "--family", "qwen2_vl", "--preset", "tiny", "--work-dir", str(tmp_path)]
        args += ["--device", "cpu", "--batch-sizes", "1", "--input-len", "8", "--output-len", "2"]
        args += ["--warmup", "0", "--iters", "1", "--baseline", "none", "--image-size", "56"]
        args += ["--tensor-parallel-size", "2", "--enforce-eager", "--out", str(out)]
        assert main([*args, "--images-per-request", str(n), "--mm-encoder-tp-mode", mode]) == 0
        return json.loads(out.read_text())

    one, three = run(1, "driver"), run(3, "data")
    assert three["errors"] == [] and three["config"]["mm_encoder_tp_mode"] == "data"
    assert three["config"]["images_per_request"] == 3
    tokens = [r["results"][0]["mmserve"]["prompt_tokens"] for r in (one, three)]
    image_tokens = tokens[0] - one["model"]["text_tokens"]  # one 56-pixel picture's placeholders
    assert image_tokens > 0 and tokens[1] >= tokens[0] + 2 * image_tokens
    # transformers' baseline times one picture per request
    with pytest.raises(ValueError, match="--baseline none"):
        LatencyConfig(ModelSource(model="m"), "cpu", "float32", images_per_request=2)
