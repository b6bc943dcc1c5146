"""Image (and Qwen2-VL video) preprocessing on the GPU (multimodal/processors.py).

A CUDA engine (ModelConfig.preprocess_on_gpu, the default) hands `device="cuda"` to the checkpoint's HF processor.
In transformers 5 the image processors of both families tested here are torchvision-backend classes
(CLIPImageProcessor for LLaVA-1.5, Qwen2VLImageProcessor and Qwen2VLVideoProcessor for Qwen2-VL), so the resize,
crop, rescale and normalisation all run on the GPU; PIL only decodes. The pixel values must stay on the GPU and
agree with mmserve's CPU path (the same torchvision processor on the CPU) and with transformers' PIL-backend
processor (the classic one).

How close is justified: every path resizes a uint8 image to a uint8 image (bicubic, antialiased), then crops and
normalises in fp32 the same way, so differences are whole uint8 steps ("levels": |diff| * 255 * std of the
channel). The CPU path (torchvision's native uint8 kernel, like PIL's) computes with fixed-point weights and
rounds and clamps to uint8 between its horizontal and vertical passes; the CUDA path interpolates in fp32 and
rounds once. So most values agree exactly, a few per cent round the other way (one level), and where the first
pass rings past 0 or 255 at a hard edge the CPU path clamps that early. Bicubic's (a = -0.5) negative lobes sum
to at most 0.125 of a step and its weights' magnitudes to 1.25, so an early clamp moves a value by at most
0.125 * 255 * 1.25 + 1 ~ 41 levels: the cap on single values. The mean and the share of values more than one
level off are what a wrong filter, crop or normalisation would break. Emulating the CUDA arithmetic on the CPU
(fp32 interpolation, one final rounding) on these images gave: mean <= 0.032 level, <= 0.13 % of values more
than one level off, at most 17 levels (an upscaled picture with 1-pixel lines); the PIL processor differs from
the CPU path the same way. The bounds leave 3-4x room.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmserve.models.loader import load_hf_config
from mmserve.models.registry import get_model_class
from mmserve.multimodal.processors import InputProcessor
from mmserve.testing import make_test_image
from mmserve.testing.llava import make_llava_checkpoint
from mmserve.testing.qwen2_vl import make_qwen2_vl_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
# (width, height): upscales (the first two), downscales of several aspect ratios, and an exact 336 x 336
SIZES = [(48, 40), (97, 61), (333, 517), (500, 375), (640, 480), (1024, 200), (336, 336)]
# versus mmserve's CPU path / versus transformers' PIL backend: (max levels, mean levels, share of values more
# than one level off)
TIGHT = (42.0, 0.1, 5e-3)
LOOSE = (42.0, 0.2, 1e-2)
QWEN_IMG = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VID = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def images() -> list:
    return [make_test_image(i, size=size) for i, size in enumerate(SIZES)]


@pytest.fixture(scope="module")
def llava_336_dir(tmp_path_factory) -> str:
    # LLaVA-1.5's CLIP-L/336 preprocessing (shortest edge 336, centre crop 336, CLIP mean / std) on a tiny model
    return str(
        make_llava_checkpoint(
            tmp_path_factory.mktemp("llava_336"), preset="tiny", seed=0, image_size=336
        )
    )


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory) -> str:
    return str(
        make_qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2_vl_pre"), preset="tiny", seed=0)
    )


def _cpu_and_gpu(model_dir: str) -> tuple[InputProcessor, InputProcessor]:
    """Two InputProcessors of the checkpoint, as an engine builds them on the CPU and on a GPU."""
    hf_config = load_hf_config(model_dir)
    model_cls = get_model_class(hf_config)
    return (
        InputProcessor(model_dir, hf_config, model_cls),
        InputProcessor(model_dir, hf_config, model_cls, device=CUDA),
    )


def _levels(diff: torch.Tensor, std: list[float], patches: bool) -> torch.Tensor:
    """|diff| of normalised pixel values in uint8 steps of their channel. patches: Qwen2-VL's rows of
    (channel, time, patch, patch); otherwise [3, H, W]."""
    scale = torch.tensor(std, dtype=torch.float64) * 255
    diff = diff.double().abs()
    return (
        diff.reshape(len(diff), 3, -1) * scale[None, :, None]
        if patches
        else diff * scale[:, None, None]
    )


def _assert_close_in_levels(
    got: torch.Tensor,
    want: torch.Tensor,
    std: list[float],
    patches: bool,
    bounds: tuple[float, float, float],
    what: str,
) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite pixel values"
    lv = _levels(got.cpu() - want.cpu(), std, patches)
    max_levels, mean_levels, share = bounds
    over = (lv > 1.01).double().mean().item()
    stats = (
        f"max {lv.max().item():.2f}, mean {lv.mean().item():.4f} levels, {over:.2%} over one level"
    )
    assert lv.max().item() <= max_levels and lv.mean().item() <= mean_levels and over <= share, (
        f"{what}: {stats}"
    )


def _pixels(item) -> torch.Tensor:
    pv = item.data["pixel_values"]
    assert pv.is_cuda and pv.dtype == torch.float32, (
        f"pixel values on {pv.device} as {pv.dtype}, not CUDA fp32"
    )
    return pv


def test_cuda_engine_preprocesses_on_the_gpu_by_default(tiny_llava_dir):
    from mmserve import LLM, SamplingParams

    llm = LLM(tiny_llava_dir, device="cuda", dtype="float16", max_num_seqs=2, enforce_eager=True)
    inputs = llm.engine.inputs
    assert inputs.device is not None and inputs.device.type == "cuda"
    prompt = {"prompt": "USER: <image>\nhi ASSISTANT:", "images": [make_test_image(3)]}
    (item,) = inputs.process(prompt).mm_items
    _pixels(item)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1


def test_llava_clip_336_preprocessing_on_gpu(llava_336_dir, images):
    from transformers import CLIPImageProcessorPil

    cpu, gpu = _cpu_and_gpu(llava_336_dir)
    pil = CLIPImageProcessorPil.from_pretrained(llava_336_dir)
    std = list(pil.image_std)
    # all pictures in one prompt (the full HF processor, images of different sizes in one call), then one by one
    # (the placeholder-expansion shortcut: the image processor alone)
    together = {
        "prompt": "USER: " + "<image>\n" * len(images) + "describe ASSISTANT:",
        "images": images,
    }
    got_all, want_all = gpu.process(together), cpu.process(together)
    assert got_all.prompt_token_ids == want_all.prompt_token_ids
    assert len(got_all.mm_items) == len(images)
    for k, image in enumerate(images):
        single = {"prompt": "USER: <image>\ndescribe ASSISTANT:", "images": [image]}
        (got_one,), (want_one,) = gpu.process(single).mm_items, cpu.process(single).mm_items
        reference = pil(image, return_tensors="pt")["pixel_values"][0]
        what = f"image {k} ({image.size[0]}x{image.size[1]})"
        for got, want, how in (
            (got_all.mm_items[k], want_all.mm_items[k], "in one prompt"),
            (got_one, want_one, "alone"),
        ):
            assert got.content_hash == want.content_hash and got.length == want.length == 576
            pv = _pixels(got)
            assert pv.shape == (3, 336, 336)
            _assert_close_in_levels(
                pv, want.data["pixel_values"], std, False, TIGHT, f"{what} {how} vs CPU path"
            )
            _assert_close_in_levels(
                pv, reference, std, False, LOOSE, f"{what} {how} vs PIL processor"
            )


def test_qwen2_vl_image_preprocessing_on_gpu(qwen2_vl_dir, images):
    from transformers import Qwen2VLImageProcessorPil

    cpu, gpu = _cpu_and_gpu(qwen2_vl_dir)
    pil = Qwen2VLImageProcessorPil.from_pretrained(qwen2_vl_dir)
    std = list(pil.image_std)
    prompt = {
        "prompt": f"<|im_start|>user\n{QWEN_IMG * len(images)}describe<|im_end|>\n<|im_start|>assistant\n",
        "images": images,
    }
    got, want = gpu.process(prompt), cpu.process(prompt)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert torch.equal(got.prompt_positions, want.prompt_positions)
    assert len(got.mm_items) == len(images)
    for k, (image, g, w) in enumerate(zip(images, got.mm_items, want.mm_items)):
        what = f"image {k} ({image.size[0]}x{image.size[1]})"
        ref = pil(image, return_tensors="pt")
        grid = g.data["grid_thw"]
        assert not grid.is_cuda, "grids come back to the host with the preprocessing"
        assert grid.tolist() == w.data["grid_thw"].tolist() == ref["image_grid_thw"][0].tolist(), (
            what
        )
        pv = _pixels(g)
        _assert_close_in_levels(pv, w.data["pixel_values"], std, True, TIGHT, f"{what} vs CPU path")
        _assert_close_in_levels(
            pv, ref["pixel_values"], std, True, LOOSE, f"{what} vs PIL processor"
        )


def test_qwen2_vl_video_preprocessing_on_gpu(qwen2_vl_dir):
    """Decoded frames [F, H, W, 3] through the video processor (torchvision too) on the GPU vs the CPU path."""
    cpu, gpu = _cpu_and_gpu(qwen2_vl_dir)
    frames = np.stack([np.asarray(make_test_image(40 + f, size=(160, 120))) for f in range(4)])
    prompt = {
        "prompt": f"<|im_start|>user\n{QWEN_VID}describe<|im_end|>\n<|im_start|>assistant\n",
        "videos": [frames],
    }
    got, want = gpu.process(prompt), cpu.process(prompt)
    assert got.prompt_token_ids == want.prompt_token_ids
    (g,), (w,) = got.mm_items, want.mm_items
    assert g.modality == "video"
    assert (
        not g.data["grid_thw"].is_cuda
        and g.data["grid_thw"].tolist() == w.data["grid_thw"].tolist()
    )
    std = list(cpu.processor.video_processor.image_std)
    _assert_close_in_levels(
        _pixels(g), w.data["pixel_values"], std, True, TIGHT, "video vs CPU path"
    )
