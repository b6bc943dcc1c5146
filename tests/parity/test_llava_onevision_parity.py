"""Greedy ids and log-probs of mmserve vs transformers on tiny random LLaVA-OneVision checkpoints.

Images (anyres_max: large mosaics are downscaled), videos given as decoded frames or as an encoded file,
both in one prompt; continuous batching mixed with other requests, prefix-cache hits, chunked prefill
cutting through image and video tokens, and refusal of unusable media.
"""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor, LlavaOnevisionForConditionalGeneration

from mmserve import LLM, SamplingParams
from mmserve.models.llava_onevision import LlavaOnevisionForConditionalGeneration as Ours
from mmserve.multimodal.video import decode_video
from mmserve.testing import make_test_image
from mmserve.testing.llava_onevision import make_llava_onevision_checkpoint
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 32
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (width, height): 1x2 mosaic with columns unpadded; 2x3 with rows unpadded then downscaled; 3x3 downscaled
SIZES = [(48, 40), (140, 60), (90, 100)]


@pytest.fixture(scope="module")
def ov_dir(tmp_path_factory) -> str:
    return str(
        make_llava_onevision_checkpoint(tmp_path_factory.mktemp("llava_ov"), preset="tiny", seed=0)
    )


@pytest.fixture(scope="module")
def ov_tied_dir(tmp_path_factory) -> str:
    return str(
        make_llava_onevision_checkpoint(
            tmp_path_factory.mktemp("llava_ov_tied"), preset="tiny-tied", seed=2
        )
    )


def _frames(seed: int, num_frames: int = 4, height: int = 32, width: int = 40) -> np.ndarray:
    return np.random.RandomState(seed).randint(
        0, 256, (num_frames, height, width, 3), dtype=np.uint8
    )


def _encode_mp4(num_frames: int = 12, size: int = 32) -> bytes:
    """A small real video: a bright square sliding over a colour ramp."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for t in range(num_frames):
            img = np.zeros((size, size, 3), dtype=np.uint8)
            img[..., 0] = np.linspace(0, 255, size, dtype=np.uint8)[None, :]
            img[..., 2] = 20 * t
            img[8:16, 2 * t : 2 * t + 8] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _prompt(i: int, sizes: list[tuple[int, int]], videos: list | None = None) -> dict:
    words = " ".join(["tell me about it"] * (i % 3 + 1))
    tags = "<image>" * len(sizes) + "<video>" * len(videos or [])
    out = {
        "prompt": f"<|im_start|>user {tags}\n{words} number {i}<|im_end|>\n<|im_start|>assistant\n",
        "images": [make_test_image(10 * i + k, size) for k, size in enumerate(sizes)],
    }
    if videos:
        out["videos"] = videos
    return out


def _check(
    model_dir: str, prompt: dict, out, device: str = "cpu", videos: list | None = None
) -> None:
    """videos: the decoded frames HF should see (default: the prompt's own arrays)."""
    check_against_hf(model_dir, prompt, out, N, device, videos=videos)


def _runs(llm: LLM, prompt: dict) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {"image": [], "video": []}
    for it in llm.engine.inputs.process(prompt).mm_items:
        out[it.modality].append((it.offset, it.length))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_single_downscaled_image_matches_transformers(ov_dir, device):
    llm = LLM(ov_dir, device=device, dtype="float32")
    prompt = _prompt(0, [SIZES[1]])
    _check(ov_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_two_images_of_different_sizes_and_aspects_match(ov_dir, device):
    llm = LLM(ov_dir, device=device, dtype="float32")
    prompt = _prompt(1, [SIZES[0], SIZES[2]])
    assert len({n for _, n in _runs(llm, prompt)["image"]}) == 2
    _check(ov_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


@pytest.mark.parametrize("device", DEVICES)
def test_video_frames_and_image_plus_video_match(ov_dir, device):
    llm = LLM(ov_dir, device=device, dtype="float32")
    video_only = _prompt(2, [], [_frames(0)])
    both = _prompt(3, [SIZES[0]], [_frames(1, num_frames=3)])
    assert (
        _runs(llm, video_only)["video"][0][1] == 4 * 3 * 3 + 1
    )  # 6x6 patches pooled to 3x3, + newline
    for prompt, out in zip((video_only, both), llm.generate([video_only, both], GREEDY)):
        _check(ov_dir, prompt, out, device)


def test_encoded_video_file_matches_transformers_on_the_same_frames(ov_dir):
    llm = LLM(ov_dir, device="cpu", dtype="float32")
    data = _encode_mp4()
    prompt = _prompt(4, [], [data])
    prompt["video_num_frames"] = 5
    out = llm.generate([prompt], GREEDY)[0]
    frames = decode_video(data, 5)
    assert frames.shape == (5, 32, 32, 3)
    _check(ov_dir, prompt, out, videos=[frames])


def test_tied_embeddings_and_two_feature_layers_match(ov_tied_dir):
    llm = LLM(ov_tied_dir, device="cpu", dtype="float32")
    prompt = _prompt(5, [SIZES[2]], [_frames(2, num_frames=2)])
    _check(ov_tied_dir, prompt, llm.generate([prompt], GREEDY)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_batch_with_staggered_arrivals_matches_single_requests(ov_dir, device):
    llm = LLM(ov_dir, device=device, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    prompts = [
        _prompt(0, [SIZES[0]]),
        {"prompt": "<|im_start|>user \njust text<|im_end|>\n<|im_start|>assistant\n"},
        _prompt(1, [], [_frames(3)]),
        _prompt(2, [SIZES[1], SIZES[0]]),
        _prompt(3, [], [_frames(4)]),
        _prompt(4, [SIZES[2]], [_frames(5, num_frames=2)]),
    ]
    for prompt, out in zip(prompts, run_staggered(engine, prompts, GREEDY)):
        _check(ov_dir, prompt, out, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_video_and_image_hit_the_prefix_cache(ov_dir, device):
    llm = LLM(ov_dir, device=device, dtype="float32", block_size=4)
    prompt = _prompt(6, [SIZES[1]], [_frames(6)])
    first = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    again = _prompt(6, [SIZES[1]], [_frames(6).copy()])  # same media, new objects
    second = llm.generate([again], GREEDY)[0]
    assert second.metrics.num_cached_tokens >= len(second.prompt_token_ids) - 4
    _check(ov_dir, again, second, device)
    other = _prompt(6, [SIZES[1]], [_frames(7)])  # same image, other video
    third = llm.generate([other], GREEDY)[0]
    video_offset = _runs(llm, other)["video"][0][0]
    assert 0 < third.metrics.num_cached_tokens <= video_offset
    _check(ov_dir, other, third, device)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_splitting_image_and_video_tokens_matches(ov_dir, device):
    chunk = 7
    llm = LLM(
        ov_dir,
        device=device,
        dtype="float32",
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    prompt = _prompt(7, [SIZES[0]], [_frames(8, num_frames=3)])
    runs = _runs(llm, prompt)
    assert all(
        any(off < b < off + n for b in range(0, off + n, chunk))
        for off, n in runs["image"] + runs["video"]
    )
    _check(ov_dir, prompt, llm.generate([prompt], GREEDY)[0], device)


def test_nested_multi_image_sample_is_packed_untiled_as_hf_does(ov_dir):
    """HF's processor tiles no image of a sample given as a nested list; our items and embeddings follow it."""
    processor, config = AutoProcessor.from_pretrained(ov_dir), AutoConfig.from_pretrained(ov_dir)
    enc = processor(
        text=["<|im_start|>user <image><image>\nhi"],
        images=[[make_test_image(1, SIZES[0]), make_test_image(2, SIZES[1])]],
        return_tensors="pt",
    )
    items = Ours.build_mm_items(config, enc, enc["input_ids"][0].tolist(), ["a", "b"], [])
    assert [(len(it.data["pixel_values"]), it.length) for it in items] == [
        (1, 37),
        (1, 37),
    ]  # 6*6 + newline
    ours = LLM(ov_dir, device="cpu", dtype="float32").engine.model
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(ov_dir).eval()
    with torch.no_grad():
        ref = hf.model.get_image_features(
            enc["pixel_values"], enc["image_sizes"], batch_num_images=enc["batch_num_images"]
        ).pooler_output
        got = ours.get_mm_embeddings(items)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_unusable_media_are_refused_with_a_clear_error(ov_dir):
    llm = LLM(ov_dir, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"image 0 is 2x5 pixels; images must be at least 4x4"):
        llm.generate(
            [{"prompt": "<|im_start|>user <image>\nhi", "images": [Image.new("RGB", (2, 5))]}],
            GREEDY,
        )
    with pytest.raises(
        ValueError, match=r"videos\[0\]: 120 frames, allowed 1 to max_video_frames=64"
    ):
        llm.generate([_prompt(0, [], [_frames(9, num_frames=120, height=8, width=8)])], GREEDY)
    # each video is within max_video_frames, but 2 * (64 frames * 9 pooled tokens + 1) > the tiny model's 1024
    long_clip = _frames(9, num_frames=64, height=8, width=8)
    with pytest.raises(
        ValueError, match=r"too many video frames: 2 video\(s\) of 64 frames need 1154 tokens"
    ):
        llm.generate([_prompt(0, [], [long_clip, long_clip])], GREEDY)
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running


def test_chat_with_a_video_part_equals_the_direct_prompt(ov_dir):
    """OpenAI-style chat content `video_url` (a data URI here) goes through the chat template like an image."""
    llm = LLM(ov_dir, device="cpu", dtype="float32")
    mp4 = _encode_mp4()
    uri = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": uri}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    chat = llm.chat(
        messages, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    assert "<video>" in chat.prompt
    direct = llm.generate(
        [{"prompt": chat.prompt, "videos": [mp4]}],
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    video_id = llm.engine.hf_config.video_token_index
    assert chat.prompt_token_ids.count(video_id) > 0
    with pytest.raises(ValueError, match="unsupported content part type 'audio_url'"):
        llm.chat([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": uri}}]}])
