"""The cross-attention families' encoder keys/values budget (TensorRT-LLM's cross_kv_cache_fraction): each family
knows the bytes of an item's states before encoding them, the KV pool gives up that fraction of its budget for them,
and the scheduler runs only as many requests with pictures as their states fit in it; a request larger than the
whole budget is refused naming its images."""
from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.config import CacheConfig
from mmserve.testing import make_test_image
from mmserve.testing.blip2 import make_blip2_checkpoint
from mmserve.testing.mllama import make_mllama_checkpoint
from mmserve.testing.nougat import make_nougat_checkpoint
from mmserve.testing.pix2struct import make_pix2struct_checkpoint

MAKERS = {
    "mllama": (lambda d: make_mllama_checkpoint(d, preset="tiny", seed=0), "<|image|>What is it?"),
    "nougat": (lambda d: make_nougat_checkpoint(d, preset="tiny", seed=0), ""),
    "blip2_t5": (lambda d: make_blip2_checkpoint(d, preset="tiny-t5", seed=0), "Question: what? Answer:"),
    "pix2struct": (lambda d: make_pix2struct_checkpoint(d, preset="tiny", seed=0, progress=False), "Which year?"),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: str(make(tmp_path_factory.mktemp(name))) for name, (make, _) in MAKERS.items()}


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_each_family_knows_its_states_bytes_before_encoding(family, family_dirs):
    llm = LLM(family_dirs[family], device="cpu", dtype="float32")
    for size in ((40, 30), (64, 64), (90, 50)):
        items = llm.engine.inputs.process({"prompt": MAKERS[family][1], "images": [make_test_image(1, size)]}).mm_items
        states = llm.engine.model.get_mm_embeddings(items)
        assert [llm.engine.model.encoder_state_bytes(it) for it in items] == \
            [s.numel() * s.element_size() for s in states], size


def test_the_pool_gives_up_the_fraction_for_states(family_dirs):
    plain = LLM(family_dirs["nougat"], device="cpu", dtype="float32", kv_cache_size_gb=0.01)
    runner = plain.engine.runner
    assert runner.encoder_state_budget == int(0.01 * 2**30 * 0.5)
    assert plain.engine.kv.num_blocks == int((0.01 * 2**30 - runner.encoder_state_budget) // runner.kv_bytes_per_block())
    quarter = LLM(family_dirs["nougat"], device="cpu", dtype="float32", kv_cache_size_gb=0.01,
                  cross_kv_cache_fraction=0.25)
    assert quarter.engine.scheduler.encoder_state_budget == int(0.01 * 2**30 * 0.25)
    fixed = LLM(family_dirs["nougat"], device="cpu", dtype="float32", num_kv_blocks=64)
    assert fixed.engine.scheduler.encoder_state_budget is None
    with pytest.raises(ValueError, match="cross_kv_cache_fraction must be in"):
        CacheConfig(cross_kv_cache_fraction=1.0)


def test_requests_wait_for_room_for_their_states_and_match_an_unbounded_run(family_dirs):
    model_dir, text = family_dirs["pix2struct"], MAKERS["pix2struct"][1]
    prompts = [{"prompt": text, "images": [make_test_image(i, (40 + 5 * i, 30))]} for i in range(6)]
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    free = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    llm = LLM(model_dir, device="cpu", dtype="float32")
    engine, sched = llm.engine, llm.engine.scheduler
    one = max(engine.model.encoder_state_bytes(engine.inputs.process(p).mm_items[0]) for p in prompts)
    sched.encoder_state_budget = 2 * one   # room for two pictures' states at a time
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    most, outs = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        most = max(most, sum(1 for r in sched.running if r.holds_encoder_budget))
        assert sched.encoder_state_in_use <= sched.encoder_state_budget
    assert most == 2 and [outs[str(i)] for i in range(6)] == want
    assert sched.encoder_state_in_use == 0
    sched.encoder_state_budget = one - 1
    with pytest.raises(ValueError, match="images: their encoder keys/values take"):
        engine.add_request("big", prompts[0], params)
