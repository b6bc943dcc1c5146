"""Greedy ids and log-probs of mmserve vs transformers on tiny random LLaVA-NeXT checkpoints.

Images of different sizes and aspect ratios give different tile mosaics and placeholder counts; covers one
and two images, continuous batching mixed with text-only requests, prefix-cache hits, chunked prefill
cutting through image tokens, and refusal of unusable images.
"""

from __future__ import annotations

import pytest
from PIL import Image

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.llava_next import make_llava_next_checkpoint
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 32
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (width, height): a 1x2 mosaic with columns unpadded, a 1x2 with rows unpadded, a 2x2, a 2x1
SIZES = [(48, 40), (80, 30), (90, 100), (30, 70)]


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory) -> str:
    return str(
        make_llava_next_checkpoint(tmp_path_factory.mktemp("llava_next"), preset="tiny", seed=0)
    )


@pytest.fixture(scope="module")
def next_llama_dir(tmp_path_factory) -> str:
    return str(
        make_llava_next_checkpoint(
            tmp_path_factory.mktemp("llava_next_llama"), preset="tiny-llama", seed=1
        )
    )


def _prompt(i: int, sizes: list[tuple[int, int]]) -> dict:
    words = " ".join(["tell me about it"] * (i % 3 + 1))
    tags = "".join("<image>\n" for _ in sizes)
    return {
        "prompt": f"[INST] {tags}{words} number {i} [/INST]",
        "images": [make_test_image(10 * i + k, size) for k, size in enumerate(sizes)],
    }


def _check(model_dir: str, prompt: dict, out, device: str = "cpu") -> None:
    check_against_hf(model_dir, prompt, out, N, device)


def _image_runs(llm: LLM, prompt: dict) -> list[tuple[int, int]]:
    return [(it.offset, it.length) for it in llm.engine.inputs.process(prompt).mm_items]


@pytest.mark.parametrize("device", DEVICES)
def test_single_image_matches_transformers(next_dir, device):
    llm = LLM(next_dir, device=device, dtype="float32")
    prompt = _prompt(0, [SIZES[0]])
    _check(next_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_two_images_of_different_sizes_and_aspects_match(next_dir, device):
    llm = LLM(next_dir, device=device, dtype="float32")
    prompt = _prompt(1, [SIZES[1], SIZES[2]])
    runs = _image_runs(llm, prompt)
    assert len({n for _, n in runs}) == 2  # variable token counts per image
    _check(next_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


def test_llama_backbone_with_two_feature_layers_matches(next_llama_dir):
    llm = LLM(next_llama_dir, device="cpu", dtype="float32")
    prompt = _prompt(2, [SIZES[3], SIZES[0]])
    _check(next_llama_dir, prompt, llm.generate([prompt], GREEDY)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_batch_with_staggered_arrivals_matches_single_requests(next_dir, device):
    llm = LLM(next_dir, device=device, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    # text-only, one image, two images; same-mosaic images of different requests share a tower batch
    image_sets = [[], [SIZES[0]], [SIZES[1], SIZES[2]], [SIZES[3]], [], [SIZES[0], SIZES[1]]]
    prompts = [
        _prompt(i, s) if s else {"prompt": f"[INST] just text number {i} [/INST]"}
        for i, s in enumerate(image_sets)
    ]
    for prompt, out in zip(prompts, run_staggered(engine, prompts, GREEDY)):
        _check(next_dir, prompt, out, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_image_hits_the_prefix_cache(next_dir, device):
    llm = LLM(next_dir, device=device, dtype="float32", block_size=4)
    prompt = _prompt(3, [SIZES[2]])
    first = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    again = {
        "prompt": prompt["prompt"],
        "images": [make_test_image(30, SIZES[2])],
    }  # same pixels, new object
    second = llm.generate([again], GREEDY)[0]
    ((offset, _),) = _image_runs(llm, again)
    assert (
        second.metrics.num_cached_tokens >= len(second.prompt_token_ids) - 4
    )  # all but the last block
    _check(next_dir, again, second, device)
    other = {
        "prompt": prompt["prompt"],
        "images": [make_test_image(99, SIZES[2])],
    }  # same size, other pixels
    third = llm.generate([other], GREEDY)[0]
    assert third.metrics.num_cached_tokens <= offset
    _check(next_dir, other, third, device)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_splitting_image_tokens_matches(next_dir, device):
    chunk = 7
    llm = LLM(
        next_dir,
        device=device,
        dtype="float32",
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    prompt = _prompt(4, [SIZES[0], SIZES[3]])
    runs = _image_runs(llm, prompt)
    # chunk boundaries fall strictly inside both images' placeholder runs
    assert all(any(off < b < off + n for b in range(0, off + n, chunk)) for off, n in runs)
    _check(next_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


def test_unusable_images_are_refused_with_a_clear_error(next_dir):
    llm = LLM(next_dir, device="cpu", dtype="float32")
    prompt = "[INST] <image>\nwhat is it [/INST]"
    with pytest.raises(ValueError, match=r"image 0 is 3x3 pixels; images must be at least 4x4"):
        llm.generate([{"prompt": prompt, "images": [Image.new("RGB", (3, 3))]}], GREEDY)
    with pytest.raises(
        ValueError, match=r"image 0 is 400x4 pixels: its aspect ratio is too extreme"
    ):
        llm.generate([{"prompt": prompt, "images": [Image.new("RGB", (400, 4))]}], GREEDY)
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
