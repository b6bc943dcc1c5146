"""Tensor parallelism over each decoder-only family (CPU, gloo, a real worker process): two shards give one
process's greedy tokens and log-probs for a prompt with pictures (Qwen2-VL: M-RoPE positions; BLIP-2: OPT;
Fuyu: Persimmon with q/k LayerNorms; LLaVA-NeXT / OneVision: any-resolution tiles; Pixtral: its ViT; Kosmos-2:
sub-LayerNorms over features split across the ranks, layers/norm.py ShardedLayerNorm); the encoder-decoders
(BLIP-2 with Flan-T5, Nougat, Deplot: the driver runs the encoder, each rank projects its own heads' cross
keys/values from the states it broadcasts, T5's relative-position bias split by heads); Llama 3.2 Vision's
cross-attention over a staggered batch (each rank's own keys/values in its pool); preempted requests recompute
(Mllama re-encoding its pictures) and still give one process's tokens; every rank's activation profile runs the
same layers. The family table (each family whose testing module declares a `FamilyCase.prompt`), the
encoder-decoders and Mllama also run on two GPUs (`-m gpu`, NCCL, CUDA graphs)."""

from __future__ import annotations

import math

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.startup import on_every_rank, profile_templates
from mmserve.testing import family_cases, make_checkpoint, make_test_image
from tests.parity.hf_oracle import assert_two_shards_match_one

N = 8
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=2)
FAMILIES = {family: case for family, case in family_cases().items() if case.prompt is not None}


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_shards_give_one_process_tokens(family, tmp_path, device):
    case = FAMILIES[family]
    model_dir = str(make_checkpoint(family, tmp_path / family, preset="tiny", seed=0))
    size = case.image_size
    prompts = [
        {
            "prompt": case.prompt.format(i),
            "images": [make_test_image(3 * i + 1, size) if size else make_test_image(3 * i + 1)],
        }
        for i in range(2)
    ]
    assert_two_shards_match_one(
        model_dir, prompts, device, max_num_seqs=4
    )  # few CUDA graphs to capture


ENCODER_DECODERS = {  # family: (writer preset, the prompt's text, picture size)
    "blip2": ("tiny-t5", "Question: what is {}? Answer:", None),
    "nougat": ("tiny", "", (67, 80)),
    "pix2struct": ("tiny", "Generate underlying data table of the figure below:", (59, 45)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(ENCODER_DECODERS))
def test_encoder_decoder_over_two_shards(family, tmp_path, device):
    preset, text, size = ENCODER_DECODERS[family]
    model_dir = str(make_checkpoint(family, tmp_path / family, preset=preset, seed=0))
    prompts = [
        {
            "prompt": text.format(i),
            "images": [make_test_image(5 * i + 2, *([size] if size else []))],
        }
        for i in range(2)
    ]
    assert_two_shards_match_one(
        model_dir, prompts, device, max_num_seqs=4
    )  # few CUDA graphs to capture


@pytest.mark.parametrize("device", DEVICES)
def test_mllama_cross_attention_over_two_shards(tmp_path, device):
    """Llama 3.2 Vision: the driver encodes each picture once and broadcasts its states, each rank projects its
    own heads' cross-attention keys/values into its pool (the same blocks everywhere); a staggered batch mixing
    two images, adjacent images, text before an image and text-only requests, with prefill chunks beside decodes
    and a repeated picture served from the encoder cache, gives one process's tokens and log-probs, and every
    pool block comes back."""
    from mmserve.testing.mllama import make_mllama_checkpoint
    from tests.parity.hf_oracle import run_staggered

    model_dir = str(make_mllama_checkpoint(tmp_path / "mllama", preset="tiny", seed=0))
    texts = [
        "first <|image|> then <|image|> compare them",
        "Look at this: <|image|> what is it?",
        "A plain question without a picture",
        "<|image|><|image|> both, then text",
        "again <|image|> here",
    ]
    images = [
        [
            make_test_image(5 * i + k, (48, 40) if k % 2 else (60, 30))
            for k in range(t.count("<|image|>"))
        ]
        for i, t in enumerate(texts)
    ]
    images[4] = [images[1][0]]  # the same picture again: its states come from the encoder cache
    prompts = [{"prompt": "<|begin_of_text|>" + t, "images": im} for t, im in zip(texts, images)]
    kw = dict(device=device, dtype="float32", max_num_batched_tokens=24, block_size=4)
    with LLM(model_dir, tensor_parallel_size=2, **kw) as llm:
        engine = llm.engine
        two = run_staggered(engine, prompts, GREEDY)
        assert engine.scheduler.cross_blocks.num_free == engine.runner.cross_kv.num_blocks
        assert engine.kv.pool.num_free == engine.kv.num_blocks
    one = run_staggered(LLM(model_dir, **kw).engine, prompts, GREEDY)
    for a, b in zip(two, one):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in lb.items():
                assert math.isclose(la[tok].logprob, lp.logprob, abs_tol=1e-4)


@pytest.mark.parametrize("family", ["llava", "mllama"])
def test_preempted_requests_recompute_over_two_shards(family, tmp_path):
    """A KV pool too small for every request at once: requests are preempted and recomputed (Mllama: their
    pictures re-encoded and their states broadcast again), and two shards still give one process's tokens."""
    from mmserve.testing.llava import make_llava_checkpoint
    from mmserve.testing.mllama import make_mllama_checkpoint

    make, text = {
        "llava": (make_llava_checkpoint, "USER: <image>\nq{} go on ASSISTANT:"),
        "mllama": (make_mllama_checkpoint, "<|begin_of_text|>q{} <|image|> go on"),
    }[family]
    model_dir = str(make(tmp_path / family, preset="tiny", seed=0))
    prompts = [{"prompt": text.format(i), "images": [make_test_image(20 + i)]} for i in range(4)]
    params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
    kw = dict(
        device="cpu",
        dtype="float32",
        block_size=4,
        enable_prefix_caching=False,
        num_kv_blocks=24 if family == "llava" else 16,
    )  # a few preemptions each
    with LLM(model_dir, tensor_parallel_size=2, **kw) as llm:
        two = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.stats()["num_preemptions"] > 0
    one = LLM(model_dir, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_every_rank_profiles_the_same_layers(tmp_path):
    """The KV pool's activation profile (a prompt of the step budget, which on GPUs runs before the pool is sized)
    runs on every rank at once: Mllama's workers, holding no vision tower, attend zeros shaped as the driver's
    blank picture (`Engine._profile_templates`), so every rank runs the cross-attention layers and their
    all-reduces pair up. On GPUs they did not, and startup hung; here the profile's forward runs on the CPU
    (where no memory is profiled), and afterwards the ranks still give one process's tokens."""
    from mmserve.testing.mllama import make_mllama_checkpoint

    model_dir = str(make_mllama_checkpoint(tmp_path / "mllama", preset="tiny", seed=0))
    prompts = [
        {
            "prompt": "<|begin_of_text|>Look at this: <|image|> what is it?",
            "images": [make_test_image(3)],
        }
    ]
    kw = dict(device="cpu", dtype="float32")
    with LLM(model_dir, tensor_parallel_size=2, **kw) as llm:
        engine = llm.engine
        here, workers = profile_templates(engine.model, engine.inputs.blank_image_item(), True)
        assert workers[1] is not None and workers[1][1] == engine.model.cross_kv_tokens(here[0])
        caches = list(engine.runner.kv_caches)
        on_every_rank(
            engine.runner, engine.tp_workers, "profile_prefill", (32, *here), (32, *workers)
        )
        assert all(
            a is b for a, b in zip(engine.runner.kv_caches, caches, strict=True)
        )  # its own cache is back
        assert engine.runner.attn_layers[0].kv_cache is caches[0]
        two = llm.generate(prompts, GREEDY, use_tqdm=False)
    one = LLM(model_dir, **kw).generate(prompts, GREEDY, use_tqdm=False)
    assert two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
