"""The cross-attention pool (TensorRT-LLM's cross KV cache, `cross_kv_cache_fraction`): each family knows an item's
encoder tokens and their layout before encoding them, the KV budget gives up that fraction for the pool, the
scheduler runs only as many requests with pictures as their blocks fit in it and takes the blocks back on every
path (finish, abort, preemption), and a request larger than the whole pool is refused naming its images."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.config import CacheConfig
from mmserve.engine.cross_blocks import CrossBlockAllocator
from mmserve.testing import make_test_image
from mmserve.testing.blip2 import make_blip2_checkpoint
from mmserve.testing.mllama import make_mllama_checkpoint
from mmserve.testing.nougat import make_nougat_checkpoint
from mmserve.testing.pix2struct import make_pix2struct_checkpoint
from mmserve.worker.cross_kv import CrossKVPool

MAKERS = {
    "mllama": (lambda d: make_mllama_checkpoint(d, preset="tiny", seed=0), "<|image|>What is it?"),
    "nougat": (lambda d: make_nougat_checkpoint(d, preset="tiny", seed=0), ""),
    "blip2_t5": (
        lambda d: make_blip2_checkpoint(d, preset="tiny-t5", seed=0),
        "Question: what? Answer:",
    ),
    "pix2struct": (
        lambda d: make_pix2struct_checkpoint(d, preset="tiny", seed=0, progress=False),
        "Which year?",
    ),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    return {name: str(make(tmp_path_factory.mktemp(name))) for name, (make, _) in MAKERS.items()}


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_each_family_knows_its_encoder_tokens_before_encoding(family, family_dirs):
    llm = LLM(family_dirs[family], device="cpu", dtype="float32")
    model = llm.engine.model
    layout = model.cross_kv_layout()
    for size in ((40, 30), (64, 64), (90, 50)):
        items = llm.engine.inputs.process(
            {"prompt": MAKERS[family][1], "images": [make_test_image(1, size)]}
        ).mm_items
        states = [model.cross_kv(s) for s in model.get_mm_embeddings(items)]
        assert [model.cross_kv_tokens(it) for it in items] == [len(s) for s in states], size
        for s in states:
            assert s.shape[1:] == (layout.layers, 2, layout.kv_heads, layout.head_dim)


def test_the_kv_budget_gives_up_the_fraction_for_the_pool(family_dirs):
    plain = LLM(family_dirs["nougat"], device="cpu", dtype="float32", kv_cache_size_gb=0.01)
    runner = plain.engine.runner
    budget = int(0.01 * 2**30 * 0.5)
    assert runner.cross_kv_budget == budget
    assert runner.cross_kv.num_blocks == CrossKVPool.blocks_for(
        runner.cross_kv.layout, runner.dtype, budget, runner.block_size
    )
    assert plain.engine.scheduler.cross_blocks.num_free == runner.cross_kv.num_blocks
    assert plain.engine.kv.num_blocks == int((0.01 * 2**30 - budget) // runner.kv_bytes_per_block())
    quarter = LLM(
        family_dirs["nougat"],
        device="cpu",
        dtype="float32",
        kv_cache_size_gb=0.01,
        cross_kv_cache_fraction=0.25,
    )
    assert quarter.engine.runner.cross_kv_budget == int(0.01 * 2**30 * 0.25)
    # a fixed KV pool: the cross pool gets fraction / (1 - fraction) of its bytes
    fixed = LLM(family_dirs["nougat"], device="cpu", dtype="float32", num_kv_blocks=64)
    runner = fixed.engine.runner
    assert runner.cross_kv_budget == 64 * runner.kv_bytes_per_block()
    with pytest.raises(ValueError, match="cross_kv_cache_fraction must be in"):
        CacheConfig(cross_kv_cache_fraction=1.0)


def _run(engine, prompts, params) -> tuple[dict[str, list[int]], int]:
    """Each request's tokens, and the most requests that held pool blocks at once."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        most = max(most, sum(1 for r in engine.scheduler.running if r.cross_block_ids is not None))
    return outs, most


def test_requests_wait_for_room_in_the_pool_and_match_an_unbounded_run(family_dirs):
    model_dir, text = family_dirs["pix2struct"], MAKERS["pix2struct"][1]
    prompts = [{"prompt": text, "images": [make_test_image(i, (40 + 5 * i, 30))]} for i in range(6)]
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    free = LLM(model_dir, device="cpu", dtype="float32", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in free.generate(prompts, params)]
    engine = LLM(model_dir, device="cpu", dtype="float32").engine
    one = max(
        engine.runner.cross_kv.num_blocks_of(
            engine.model.cross_kv_tokens(engine.inputs.process(p).mm_items[0])
        )
        for p in prompts
    )
    engine.scheduler.cross_blocks = blocks = CrossBlockAllocator(2 * one)  # two at a time
    outs, most = _run(engine, prompts, params)
    assert most == 2 and [outs[str(i)] for i in range(6)] == want
    assert blocks.num_free == 2 * one
    # an abort mid-run and preemptions in a tight KV pool give every block back too
    tight = LLM(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=4,
        num_kv_blocks=8,
        enable_prefix_caching=False,
        cross_kv_cache_fraction=0.9,
    ).engine
    long = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0)
    for i, p in enumerate(prompts[:4]):
        tight.add_request(str(i), p, long)
    tight.step()
    assert 0 < tight.stats()["cross_kv_cache_usage"] <= 1
    tight.abort("3")
    while tight.has_unfinished():
        tight.step()
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.cross_blocks.num_free == tight.runner.cross_kv.num_blocks
    assert tight.stats()["cross_kv_cache_usage"] == 0
    assert tight.stats()["cross_kv_cache_blocks_total"] == tight.runner.cross_kv.num_blocks


def test_a_request_larger_than_the_pool_is_refused(family_dirs):
    engine = LLM(family_dirs["pix2struct"], device="cpu", dtype="float32").engine
    prompt = {"prompt": MAKERS["pix2struct"][1], "images": [make_test_image(0, (40, 30))]}
    need = engine.runner.cross_kv.num_blocks_of(
        engine.model.cross_kv_tokens(engine.inputs.process(prompt).mm_items[0])
    )
    runner = engine.runner
    runner.cross_kv = CrossKVPool(
        runner.cross_kv.layout, runner.dtype, need - 1, runner.block_size, runner.device
    )
    with pytest.raises(ValueError, match=r"images: their encoder keys/values \(\d+ tokens"):
        engine.add_request("big", prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()


def test_a_step_admitting_many_pictures_encodes_them_a_few_at_a_time(family_dirs):
    """The activation profile measures `cross_encode_batch` pictures through the encoder; a step that admits more
    (short prompts) encodes them in groups of that many, and each answer is the one of a run without groups."""
    model_dir, text = family_dirs["mllama"], MAKERS["mllama"][1]
    prompts = [{"prompt": text, "images": [make_test_image(i, (40 + 7 * i, 30))]} for i in range(5)]
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    want = [
        o.outputs[0].token_ids
        for o in LLM(model_dir, device="cpu", dtype="float32").generate(prompts, params)
    ]
    engine = LLM(model_dir, device="cpu", dtype="float32").engine
    runner = engine.runner
    runner.cross_encode_batch = 2
    sizes, encode = [], runner.encoder.encode
    runner.encoder.encode = lambda items: sizes.append(len(items)) or encode(items)
    outs, _ = _run(engine, prompts, params)
    assert sizes == [2, 2, 1] and [outs[str(i)] for i in range(5)] == want


def test_which_decode_steps_a_cross_graph_can_take():
    """`cross_decode_inputs`: each decode's pool blocks up to the tokens it attends, or None for a step a decode graph
    cannot replay (a row without media, a prompt chunk, an encoder output not yet written, too many blocks)."""
    from types import SimpleNamespace

    from mmserve.worker.request_inputs import cross_decode_inputs

    def seq(start=10, media=True, written=True, decode_len=40, blocks=(7, 3, 9, 1, 4)):
        req = SimpleNamespace(
            mm_items=[object()] if media else [],
            cross_kv_written=written,
            num_prompt_tokens=10,
            cross_decode_len=decode_len,
            cross_block_ids=list(blocks),
        )
        return SimpleNamespace(request=req, start=start)

    assert cross_decode_inputs([seq(), seq(start=12, decode_len=16)], 4, 16) == (
        [[7, 3, 9], [7]],
        [40, 16],
    )
    for odd in (seq(media=False), seq(start=9), seq(written=False), seq(decode_len=65)):
        assert cross_decode_inputs([seq(), odd], 4, 16) is None


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_the_pool_holds_the_encoder_output_in_the_model_dtype_with_fp8_weights(family, family_dirs):
    """FP8 weights (--quantization fp8) cover the decoder's linears, Nougat's cross-attention k/v projections among
    them; the pool keeps what they output, in the model's dtype, and generation runs through it."""
    engine = LLM(family_dirs[family], device="cpu", dtype="float32", quantization="fp8").engine
    prompt = {"prompt": MAKERS[family][1], "images": [make_test_image(2, (50, 40))]}
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, min_tokens=3, temperature=0.0))
    engine.step()
    req, pool = engine.requests["r"], engine.runner.cross_kv
    assert pool.storage.dtype == engine.runner.dtype
    want = engine.model.get_mm_embeddings(engine.inputs.process(prompt).mm_items)[0]
    if req.cross_kv_order is not None:
        want = want[req.cross_kv_order]
    want = engine.model.cross_kv(
        want
    )  # Mllama's encoder output is the image states; the others' their keys/values
    blocks = torch.tensor(req.cross_block_ids)
    for layer, cache in enumerate(pool.caches):
        kv = cache[:, blocks].flatten(1, 2)[:, : len(want)]
        assert torch.equal(kv[0], want[:, layer, 0]) and torch.equal(kv[1], want[:, layer, 1])
    while engine.has_unfinished():
        engine.step()


def test_an_exact_repeat_loads_its_prompt_end_and_encodes_on_its_first_decode(family_dirs):
    """A repeated Llama 3.2 Vision prompt gets its first token from the prompt-end cache (no forward pass, so no
    encoder run then); its pictures are encoded into its pool blocks on its first decode step, and it answers
    as the first one did."""
    llm = LLM(family_dirs["mllama"], device="cpu", dtype="float32")
    prompt = {
        "prompt": MAKERS["mllama"][1] + " and why" * 12,
        "images": [make_test_image(3, (60, 50))],
    }
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats["prompt_end_cache_hits"] == 1 and again == first
    assert stats["cross_kv_cache_usage"] == 0
