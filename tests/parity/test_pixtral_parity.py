"""Greedy ids and log-probs of mmserve vs transformers on tiny random Pixtral checkpoints.

Images are scaled to patch multiples of their own aspect, so each gives its own grid of `[IMG]` rows closed by
`[IMG_BREAK]` / `[IMG_END]`; covers one and two images (adjacent too, and a one-row image), a text-only prompt,
continuous batching, prefix-cache hits, chunked prefill cutting image runs, preprocessed pixel_values, the
transformers-5 tensor names and refusal of bad input.
"""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.models.loader import load_hf_config
from mmserve.models.pixtral import PixtralForConditionalGeneration
from mmserve.testing import make_test_image
from mmserve.testing.pixtral import make_pixtral_checkpoint, pixtral_token_ids
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 32
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (width, height) -> patch grid (rows x cols) at the tiny preset's 16 px patches and 64 px longest edge:
# 3x3, 2x4 (scaled down), 4x2 (rounded up), 1x4 (one row: [IMG_END] alone closes it)
SIZES = [(48, 40), (80, 30), (20, 60), (70, 10)]
IDS = pixtral_token_ids(400)


@pytest.fixture(scope="module")
def pixtral_dir(tmp_path_factory) -> str:
    return str(make_pixtral_checkpoint(tmp_path_factory.mktemp("pixtral"), preset="tiny", seed=0))


def _prompt(i: int, sizes: list[tuple[int, int]], sep: str = " ") -> dict:
    words = " ".join(["tell me about it"] * (i % 3 + 1))
    tags = sep.join("[IMG]" for _ in sizes)
    return {
        "prompt": f"[INST]{tags}{words} number {i}[/INST]",
        "images": [make_test_image(10 * i + k, size) for k, size in enumerate(sizes)],
    }


def _text_prompt(i: int) -> dict:
    return {"prompt": f"[INST]just text number {i}[/INST]"}


def _items(llm: LLM, prompt: dict) -> list:
    return llm.engine.inputs.process(prompt).mm_items


@pytest.mark.parametrize("device", DEVICES)
def test_single_image_matches_transformers(pixtral_dir, device):
    llm = LLM(pixtral_dir, device=device, dtype="float32")
    prompt = _prompt(0, [SIZES[0]])
    out = llm.generate([prompt], GREEDY)[0]
    (item,) = _items(llm, prompt)
    run = out.prompt_token_ids[item.offset : item.end]
    assert run == ([IDS["image"]] * 3 + [IDS["image_break"]]) * 2 + [IDS["image"]] * 3 + [
        IDS["image_end"]
    ]
    check_against_hf(pixtral_dir, prompt, out, N, device)


@pytest.mark.parametrize("device", DEVICES)
def test_two_images_of_different_sizes_match(pixtral_dir, device):
    llm = LLM(pixtral_dir, device=device, dtype="float32")
    prompt = _prompt(1, [SIZES[1], SIZES[2]])
    assert [(it.length, tuple(it.data["pixel_values"].shape)) for it in _items(llm, prompt)] == [
        (2 * 5, (3, 32, 64)),
        (4 * 3, (3, 64, 32)),
    ]  # each cropped out of the processor's padded batch
    check_against_hf(pixtral_dir, prompt, llm.generate([prompt], GREEDY)[0], N, device)


def test_adjacent_images_and_two_feature_layers_match(tmp_path):
    """No text between the runs; a one-row image; features of the last two blocks; text head_dim != hidden/heads."""
    model_dir = str(make_pixtral_checkpoint(tmp_path, preset="tiny-two-layers", seed=1))
    llm = LLM(model_dir, device="cpu", dtype="float32")
    prompt = _prompt(2, [SIZES[3], SIZES[0]], sep="")
    first, second = _items(llm, prompt)
    assert first.end == second.offset and first.length == 5
    check_against_hf(model_dir, prompt, llm.generate([prompt], GREEDY)[0], N)


@pytest.mark.parametrize("device", DEVICES)
def test_text_only_prompt_matches(pixtral_dir, device):
    llm = LLM(pixtral_dir, device=device, dtype="float32")
    prompt = _text_prompt(0)
    check_against_hf(pixtral_dir, prompt, llm.generate([prompt], GREEDY)[0], N, device)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_with_staggered_arrivals_matches_single_requests(pixtral_dir, device):
    llm = LLM(pixtral_dir, device=device, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    # text-only, one image, two images; same-size images of different requests share a tower batch
    image_sets = [[], [SIZES[0]], [SIZES[1], SIZES[2]], [SIZES[3]], [], [SIZES[0], SIZES[1]]]
    prompts = [_prompt(i, s) if s else _text_prompt(i) for i, s in enumerate(image_sets)]
    for prompt, out in zip(prompts, run_staggered(engine, prompts, GREEDY)):
        check_against_hf(pixtral_dir, prompt, out, N, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_image_hits_the_prefix_cache(pixtral_dir, device):
    llm = LLM(pixtral_dir, device=device, dtype="float32", block_size=4)
    prompt = _prompt(3, [SIZES[2]])
    first = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    again = {
        "prompt": prompt["prompt"],
        "images": [make_test_image(30, SIZES[2])],
    }  # same pixels, new object
    second = llm.generate([again], GREEDY)[0]
    (item,) = _items(llm, again)
    assert (
        second.metrics.num_cached_tokens >= len(second.prompt_token_ids) - 4
    )  # all but the last block
    check_against_hf(pixtral_dir, again, second, N, device)
    other = {
        "prompt": prompt["prompt"],
        "images": [make_test_image(99, SIZES[2])],
    }  # same size, other pixels
    third = llm.generate([other], GREEDY)[0]
    assert third.metrics.num_cached_tokens <= item.offset
    check_against_hf(pixtral_dir, other, third, N, device)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_splitting_image_runs_matches(pixtral_dir, device):
    chunk = 5
    llm = LLM(
        pixtral_dir,
        device=device,
        dtype="float32",
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    prompt = _prompt(4, [SIZES[0], SIZES[2]])
    items = _items(llm, prompt)
    # chunk boundaries fall strictly inside both images' runs
    assert all(any(it.offset < b < it.end for b in range(0, it.end, chunk)) for it in items)
    check_against_hf(pixtral_dir, prompt, llm.generate([prompt], GREEDY)[0], N, device)


def test_preprocessed_pixel_values_give_the_images_output(pixtral_dir):
    llm = LLM(pixtral_dir, device="cpu", dtype="float32", enable_prefix_caching=False)
    prompt = _prompt(5, [(48, 48)])  # already patch-aligned: the processor keeps its size
    (item,) = _items(llm, prompt)
    pre = {"prompt": prompt["prompt"], "pixel_values": item.data["pixel_values"][None]}
    by_image, by_pixels = (
        llm.generate([p], GREEDY)[0] for p in (prompt, pre)
    )  # a CPU batch of 2 decodes slower
    assert by_pixels.prompt_token_ids == by_image.prompt_token_ids
    assert by_pixels.outputs[0].token_ids == by_image.outputs[0].token_ids


def test_transformers_5_tensor_names_load(pixtral_dir):
    """transformers 5 names tensors `model.vision_tower.`, `model.language_model.`, `lm_head.` in memory."""
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(pixtral_dir, dtype=torch.float32)
    ours = PixtralForConditionalGeneration(load_hf_config(pixtral_dir))
    ours.load_weights(hf.state_dict().items())
    published = LLM(pixtral_dir, device="cpu", dtype="float32").engine.model.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, published[name]), name


def test_bad_inputs_are_refused_with_a_clear_error(pixtral_dir):
    llm = LLM(pixtral_dir, device="cpu", dtype="float32")
    image = make_test_image(0, SIZES[0])
    with pytest.raises(
        ValueError, match=r"the prompt has 1 \[IMG\] placeholder\(s\) but 2 image\(s\)"
    ):
        llm.generate([{"prompt": "[INST][IMG]what[/INST]", "images": [image, image]}], GREEDY)
    with pytest.raises(
        ValueError, match="pixel_values have shape"
    ):  # larger than the processor's longest edge
        llm.generate(
            [{"prompt": "[INST][IMG]what[/INST]", "pixel_values": torch.zeros(1, 3, 96, 96)}],
            GREEDY,
        )
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
    # what the HF processor cannot produce, build_mm_items still refuses by name
    hf_config = llm.engine.hf_config
    enc = dict(llm.engine.inputs.processor(text="[IMG]", images=[image], return_tensors="pt"))
    ids = enc["input_ids"][0].tolist()
    build = PixtralForConditionalGeneration.build_mm_items
    with pytest.raises(
        ValueError, match="image_sizes: image 0 is 128x48 pixels .* at most 64 pixels"
    ):
        build(hf_config, {**enc, "image_sizes": torch.tensor([[48, 128]])}, ids, ["k"], [])
    with pytest.raises(
        ValueError, match="image_sizes: image 0 is 40x48 pixels .* multiples of the patch size"
    ):
        build(hf_config, {**enc, "image_sizes": torch.tensor([[48, 40]])}, ids, ["k"], [])
    with pytest.raises(
        ValueError, match="images: the prompt's tokens for image 0 are not 3 rows of 3"
    ):
        build(
            hf_config, enc, [t if t != IDS["image_break"] else IDS["image"] for t in ids], ["k"], []
        )
    with pytest.raises(
        ValueError,
        match=r"images: the prompt has no image placeholder tokens \(id 400\) left for image 1",
    ):
        build(
            hf_config,
            {
                **enc,
                "pixel_values": enc["pixel_values"].repeat(2, 1, 1, 1),
                "image_sizes": enc["image_sizes"].repeat(2, 1),
            },
            ids,
            ["k", "k2"],
            [],
        )
    with pytest.raises(ValueError, match="videos: this model takes images only"):
        build(hf_config, enc, ids, ["k"], ["v"])
