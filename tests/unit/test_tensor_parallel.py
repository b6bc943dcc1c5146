"""Tensor parallelism (`tensor_parallel_size` 2): a real worker process holds the other shard of the language model
(gloo on the CPU, NCCL on two GPUs) and mirrors every forward; greedy ids and log-probs match transformers and the
one-process engine, through chunked prefill that cuts an image's tokens, mixed steps, prefix-cache hits and batches
joining mid-flight; LoRA adapters, beam search, n sampled sequences, prompt logprobs, int8 / int4 weight-only
quantization and a ModelOpt FP8 checkpoint give one process's results (FP8 on-the-fly: weights and scales are
one process's slices); nothing leaks, and the workers stop with the engine (also when its start fails, and a dead
worker fails the next step). Shapes and families that cannot shard are refused before anything starts."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import ModelConfig
from mmserve.models.loader import load_hf_config
from mmserve.testing import make_test_image
from mmserve.worker.tp_workers import check_tensor_parallel
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 12
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=3)
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


def _prompt(i: int, num_images: int) -> dict:
    tags = "".join("<image>\n" for _ in range(num_images))
    return {
        "prompt": f"USER: {tags}what is in picture {i}? ASSISTANT:",
        "images": [make_test_image(7 * i + k) for k in range(num_images)],
    }


@pytest.mark.parametrize("device", DEVICES)
def test_two_shards_match_transformers_and_one_process(tiny_llava_dir, device):
    prompts = [_prompt(i, i % 3) for i in range(5)]
    # 24-token steps: image prompts are chunked through their pictures' tokens, decodes ride in mixed steps
    with LLM(
        tiny_llava_dir,
        device=device,
        dtype="float32",
        tensor_parallel_size=2,
        max_num_batched_tokens=24,
        block_size=4,
    ) as llm:
        engine = llm.engine
        assert engine.tp_workers is not None and all(p.is_alive() for p in engine.tp_workers.procs)
        # the worker holds half of the language model's layers and none of the vision tower or projector
        lm = engine.model.language_model
        lm_bytes = sum(t.numel() * t.element_size() for t in (*lm.parameters(), *lm.buffers()))
        encoder_bytes = engine.runner.weight_bytes() - lm_bytes
        assert encoder_bytes > 0
        (worker_bytes,) = engine.tp_workers.call("weight_bytes")()
        assert worker_bytes == lm_bytes
        outs = run_staggered(engine, prompts, GREEDY)
        repeat = llm.generate([prompts[1]], GREEDY, use_tqdm=False)[
            0
        ]  # the same picture and text again
        assert not engine.scheduler.running and engine.kv.pool.num_free == engine.kv.num_blocks
        procs = engine.tp_workers.procs
    # every rank left the group cleanly: on CUDA that needs the captured graphs gone first (release_cuda_graphs)
    assert [p.exitcode for p in procs] == [0] and not torch.distributed.is_initialized()
    for prompt, out in zip(prompts, outs):
        check_against_hf(tiny_llava_dir, prompt, out, N, device)
    assert repeat.metrics.num_cached_tokens >= 8
    assert repeat.outputs[0].token_ids == outs[1].outputs[0].token_ids
    single = LLM(tiny_llava_dir, device=device, dtype="float32").generate(
        prompts, GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in single]


def test_sampling_with_a_seed_is_the_same_with_two_shards(tiny_llava_dir):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11)
    prompts = [_prompt(1, 1), _prompt(2, 0)]
    with LLM(tiny_llava_dir, device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        two = llm.generate(prompts, params, use_tqdm=False)
    one = LLM(tiny_llava_dir, device="cpu", dtype="float32").generate(
        prompts, params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_what_cannot_shard_is_refused_before_starting(tiny_llava_dir, tmp_path):
    hf_config = load_hf_config(tiny_llava_dir)
    with pytest.raises(ValueError, match="num_attention_heads"):  # the tiny model has 4 heads
        check_tensor_parallel(hf_config, ModelConfig(tiny_llava_dir, tensor_parallel_size=3))
    with pytest.raises(ValueError, match="cuda:1"):
        check_tensor_parallel(hf_config, _with_device(tiny_llava_dir, "cuda:1"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ModelConfig(tiny_llava_dir, tensor_parallel_size=0)
    from mmserve.testing.nougat import make_nougat_checkpoint

    nougat = load_hf_config(str(make_nougat_checkpoint(tmp_path / "nougat", preset="tiny", seed=0)))
    check_tensor_parallel(nougat, ModelConfig(tiny_llava_dir, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="does not divide"):  # 4 heads, 144 features over 5 ranks
        check_tensor_parallel(nougat, ModelConfig(tiny_llava_dir, tensor_parallel_size=5))
    from mmserve.testing.mllama import (
        make_mllama_checkpoint,
    )  # cross-attention: its pool holds kv heads per rank

    mllama = load_hf_config(str(make_mllama_checkpoint(tmp_path / "mllama", preset="tiny", seed=0)))
    check_tensor_parallel(mllama, ModelConfig(tiny_llava_dir, tensor_parallel_size=2))
    with pytest.raises(
        ValueError, match="num_key_value_heads"
    ):  # 4 heads, 2 kv heads: 4 ranks cannot split them
        check_tensor_parallel(mllama, ModelConfig(tiny_llava_dir, tensor_parallel_size=4))


def _with_device(model_dir: str, device: str) -> ModelConfig:
    """A ModelConfig naming `device` without resolving it (no CUDA needed to test the refusal)."""
    config = ModelConfig(model_dir, tensor_parallel_size=2)
    config.device = device
    return config


def test_lora_adapters_with_two_shards_give_one_process_tokens(tiny_llava_dir, lora_adapters):
    """PEFT adapters loaded at startup and an adapter sent as TensorRT-LLM tensors (evicting another, max_loras 3)
    apply on both ranks: each rank holds its slice (row-parallel layers' deltas all-reduced), and a batch mixing
    adapters and the base model gives one process's tokens."""
    from mmserve.testing.lora import trtllm_lora_tensors

    weights, config = (t.numpy() for t in trtllm_lora_tensors(lora_adapters["beta"], torch.float32))
    prompts = [
        dict(_prompt(i, 1), lora=name)
        for i, name in [(0, "alpha"), (1, "beta"), (0, None), (1, "task"), (2, "alpha")]
    ]
    outs = []
    for tp in (2, 1):
        with LLM(
            tiny_llava_dir,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=tp,
            max_loras=3,
            lora_modules={"alpha": lora_adapters["alpha"], "beta": lora_adapters["beta"]},
        ) as llm:
            llm.engine.add_lora_tensors("spare", weights, config)  # takes the last slot
            llm.engine.add_lora_tensors("task", weights, config)  # evicts "spare" on every rank
            assert llm.engine.lora.names == ("alpha", "beta", "task")
            outs.append(
                [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            )
    assert outs[0] == outs[1]
    assert outs[0][1] == outs[0][3]  # beta from its directory and from tensors
    assert outs[0][0] != outs[0][2]  # the adapter changes the answer


def test_a_failed_start_leaves_no_worker_behind(tiny_llava_dir, tmp_path):
    """An engine that cannot size its KV cache, and an LLM whose startup LoRA adapter is refused after the engine
    started: no worker process outlives either."""
    import multiprocessing

    from mmserve.testing.lora import make_lora_adapter

    def workers() -> list:
        return [p for p in multiprocessing.active_children() if p.name.startswith("mmserve-tp")]

    with pytest.raises(ValueError, match="KV cache would get 0 blocks"):
        LLM(
            tiny_llava_dir,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            kv_cache_size_gb=1e-9,
        )
    assert not workers()
    bad = make_lora_adapter(tmp_path / "bad", tiny_llava_dir, targets=("no_such_proj",))
    with pytest.raises(
        ValueError, match="has no LoRA weights"
    ):  # none of its targets is in the model
        LLM(
            tiny_llava_dir,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            lora_modules={"bad": str(bad)},
        )
    assert not workers()


def test_a_dead_worker_fails_the_next_step_instead_of_hanging(tiny_llava_dir):
    with LLM(tiny_llava_dir, device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        worker = llm.engine.tp_workers.procs[0]
        worker.kill()
        worker.join(timeout=10)
        with pytest.raises(RuntimeError, match="tensor-parallel worker 1 .* exited"):
            llm.generate(
                [_prompt(1, 1)], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False
            )


def test_beam_search_prompt_logprobs_and_n_with_two_shards(tiny_llava_dir):
    prompts = [_prompt(4, 1), _prompt(5, 0)]
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, prompt_logprobs=2)
    runs = []
    for tp in (2, 1):
        with LLM(tiny_llava_dir, device="cpu", dtype="float32", tensor_parallel_size=tp) as llm:
            beams = llm.beam_search(prompts, 3, SamplingParams(max_tokens=6))
            sampled = llm.generate(prompts, params, use_tqdm=False)
            runs.append(
                (
                    [[c.token_ids for c in o.outputs] for o in beams],
                    [[c.token_ids for c in o.outputs] for o in sampled],
                    [o.prompt_logprobs for o in sampled],
                )
            )
    (beams2, sampled2, plp2), (beams1, sampled1, plp1) = runs
    assert beams2 == beams1 and all(len(b) == 3 for b in beams2)
    assert sampled2 == sampled1 and all(len(s) == 2 for s in sampled2)
    for a, b in zip(plp2, plp1):
        assert len(a) == len(b) > 1
        for pa, pb in zip(a[1:], b[1:]):  # the first prompt token has none
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


def test_quantized_weights_over_two_shards_are_one_process_slices(tiny_llava_dir):
    """--quantization under tensor parallelism: a row-parallel shard scales each row by the whole row's maximum
    (a max over the ranks), so int8 / int4 weight-only models give one process's tokens and log-probs, and FP8's
    row-parallel weights and scales on rank 0 are the first half of one process's (its activations are scaled per
    token over each rank's slice, so FP8 outputs may differ slightly)."""
    prompts = [_prompt(i, 1) for i in range(3)]
    for method in ("int8", "int4"):
        with LLM(
            tiny_llava_dir,
            device="cpu",
            dtype="float32",
            tensor_parallel_size=2,
            quantization=method,
        ) as llm:
            two = llm.generate(prompts, GREEDY, use_tqdm=False)
        one = LLM(tiny_llava_dir, device="cpu", dtype="float32", quantization=method).generate(
            prompts, GREEDY, use_tqdm=False
        )
        for a, b in zip(two, one):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, method
            for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert all(abs(la[t].logprob - lp.logprob) < 1e-4 for t, lp in lb.items()), method
    whole = (
        LLM(tiny_llava_dir, device="cpu", dtype="float32", quantization="fp8")
        .engine.model.language_model.model.layers[0]
        .mlp.down_proj
    )
    with LLM(
        tiny_llava_dir, device="cpu", dtype="float32", tensor_parallel_size=2, quantization="fp8"
    ) as llm:
        sharded = llm.engine.model.language_model.model.layers[0].mlp.down_proj
        assert sharded.in_features * 2 == whole.in_features
        assert torch.equal(sharded.weight_scale, whole.weight_scale)
        assert torch.equal(sharded.weight.float(), whole.weight[:, : sharded.in_features].float())


def test_an_fp8_checkpoint_with_static_activation_scales_shards_exactly(tiny_llava_dir, tmp_path):
    """A ModelOpt FP8 checkpoint (per-tensor weight and static activation scales, as TensorRT-LLM's FP8 flow
    writes): every rank loads its slice and the same scales, and two shards give one process's tokens."""
    from mmserve.testing.fp8 import write_fp8_checkpoint

    fp8_dir = str(write_fp8_checkpoint(tiny_llava_dir, tmp_path / "fp8", style="modelopt"))
    prompts = [_prompt(i, 1) for i in range(3)]
    with LLM(fp8_dir, device="cpu", dtype="float32", tensor_parallel_size=2) as llm:
        two = llm.generate(prompts, GREEDY, use_tqdm=False)
    one = LLM(fp8_dir, device="cpu", dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
