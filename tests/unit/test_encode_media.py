"""AsyncEngine.encode_media: pictures through the vision tower and projector alone, on the engine thread between
steps (while requests decode), equal to the model's own get_mm_embeddings; which families have a prompt table."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.engine.async_engine import AsyncEngine, EngineStopped
from mmserve.entrypoints.triton.multimodal_encoders import no_table_reason
from mmserve.models.registry import family_named
from mmserve.testing import make_test_image

PROMPT = "USER: <image><image>\nWhat is this? ASSISTANT:"


def _engine(model_dir: str, device: str) -> AsyncEngine:
    return AsyncEngine(LLM(model_dir, device=device, dtype="float32").engine)


def _check_encode_beside_decoding(ae: AsyncEngine) -> None:
    engine = ae.engine
    inputs = engine.preprocess(
        {"prompt": PROMPT, "images": [make_test_image(1), make_test_image(2)]}
    )
    with torch.no_grad():
        want = engine.model.get_mm_embeddings(
            [engine.runner.encoder.on_device(m) for m in inputs.mm_items]
        )
    alone = [
        o.outputs[0].token_ids
        for o in engine_generate(
            ae,
            "USER: hi ASSISTANT:",
            SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0),
        )
    ]

    async def both():
        stream = ae.generate(
            "USER: hi ASSISTANT:", SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
        )
        first = await stream.__anext__()  # decoding has started
        embeddings = await ae.encode_media(inputs)
        outs = [first] + [o async for o in stream]
        return embeddings, outs[-1].outputs[0].token_ids

    embeddings, tokens = asyncio.run(both())
    assert tokens == alone[-1]  # the encode between steps left the running request alone
    assert [tuple(e.shape) for e in embeddings] == [
        (m.length, want[0].shape[-1]) for m in inputs.mm_items
    ]
    for got, ref in zip(embeddings, want):
        assert got.device.type == "cpu" and got.dtype == torch.float32
        torch.testing.assert_close(got, ref.float().cpu(), atol=1e-4, rtol=1e-4)
    assert ae.stats()["num_running"] == 0 and ae.stats()["kv_cache_usage"] == 0


def engine_generate(ae: AsyncEngine, prompt: str, params: SamplingParams) -> list:
    async def run():
        return [o async for o in ae.generate(prompt, params)]

    return asyncio.run(run())


def test_encode_media_between_steps_equals_the_models_embeddings(tiny_llava_dir):
    ae = _engine(tiny_llava_dir, "cpu")
    try:
        _check_encode_beside_decoding(ae)
    finally:
        ae.shutdown()


@pytest.mark.gpu
def test_encode_media_on_cuda_beside_decoding(tiny_llava_dir):
    """The encoder's graphs and the cache on the GPU, while a request decodes from its own graphs."""
    ae = _engine(tiny_llava_dir, "cuda")
    try:
        _check_encode_beside_decoding(ae)
    finally:
        ae.shutdown()


def test_encode_media_after_the_loop_died_is_engine_stopped(tiny_llava_dir):
    ae = _engine(tiny_llava_dir, "cpu")
    try:
        inputs = ae.engine.preprocess(
            {"prompt": "USER: <image> ASSISTANT:", "images": [make_test_image(3)]}
        )
        ae.dead_error = RuntimeError("worker gone")
        with pytest.raises(EngineStopped, match="worker gone"):
            asyncio.run(ae.encode_media(inputs))
    finally:
        ae.shutdown()


@pytest.mark.parametrize(
    "family,table",
    [("llava", True), ("qwen2_vl", False), ("mllama", False), ("cogvlm", False), ("nougat", False)],
)
def test_which_families_have_a_prompt_table(family, table):
    assert (no_table_reason(family_named(family)) is None) == table
