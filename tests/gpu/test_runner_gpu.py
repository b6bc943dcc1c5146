"""GPU runner paths: CUDA-graph decode and the Triton backend give the same tokens as eager torch."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.models.loader import load_hf_config
from mmserve.models.registry import get_model_class
from mmserve.multimodal.processors import InputProcessor
from mmserve.testing import make_test_image

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, logprobs=3)


def _prompts(n: int, filler: int = 0) -> list[dict]:
    return [
        {
            "prompt": f"USER: {'<image>' * (i % 3)}\nquestion {i} "
            + "word " * (i + filler)
            + "ASSISTANT:",
            "images": [make_test_image(i * 7 + k) for k in range(i % 3)],
        }
        for i in range(n)
    ]


def _run(model_dir: str, **kw) -> tuple[list[list[int]], LLM]:
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=8, **kw)
    outs = llm.generate(_prompts(12), PARAMS, use_tqdm=False)
    assert llm.engine.kv.usage == 0
    return [o.outputs[0].token_ids for o in outs], llm


def test_graphs_and_triton_match_eager_torch(tiny_llava_dir):
    reference, _ = _run(tiny_llava_dir, attention_backend="torch", enforce_eager=True)
    eager_triton, _ = _run(tiny_llava_dir, attention_backend="triton", enforce_eager=True)
    graphs, llm = _run(tiny_llava_dir, attention_backend="triton")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert eager_triton == reference
    assert graphs == reference


@pytest.mark.parametrize("block_size", [32, 64])
def test_larger_kv_blocks_match_eager_torch(tiny_llava_dir, block_size):
    """KV blocks of 32 / 64 tokens (a decode key tile inside one block, prompt chunks ending mid-block) through the
    Triton kernels and graphs give the tokens of eager torch with the default 16-token blocks."""
    reference, _ = _run(tiny_llava_dir, attention_backend="torch", enforce_eager=True)
    graphs, llm = _run(tiny_llava_dir, attention_backend="triton", block_size=block_size)
    assert llm.engine.kv.block_size == block_size
    assert graphs == reference


def test_half_precision_cuda_graphs_run(tiny_llava_dir):
    llm = LLM(
        tiny_llava_dir, device="cuda", dtype="float16", max_num_seqs=4, enable_prefix_caching=False
    )
    outs = llm.generate(
        _prompts(6), SamplingParams(max_tokens=16, temperature=0.8, seed=3), use_tqdm=False
    )
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    again = llm.generate(
        _prompts(6), SamplingParams(max_tokens=16, temperature=0.8, seed=3), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]


def test_async_scheduling_matches_sync_with_graphs(tiny_llava_dir):
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=3, temperature=0.0),
    ] * 4
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(
            tiny_llava_dir,
            device="cuda",
            dtype="float32",
            max_num_seqs=8,
            async_scheduling=async_scheduling,
        )
        outs = llm.generate(_prompts(12), params, use_tqdm=False)
        assert llm.engine.kv.usage == 0 and llm.engine.runner.graphs is not None
        runs.append(outs)
    # a request that stops is computed one step longer under async scheduling (its stop is read a step
    # late), which can change other rows' batch bucket: ids must match, log-probs up to kernel rounding
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
    assert [o.outputs[0].text for o in runs[0]] == [o.outputs[0].text for o in runs[1]]
    for a, b in zip(runs[0], runs[1]):
        if a.outputs[0].cumulative_logprob is not None:
            assert b.outputs[0].cumulative_logprob == pytest.approx(
                a.outputs[0].cumulative_logprob, abs=1e-3
            )


def test_encoder_graphs_match_the_eager_tower(tiny_llava_dir):
    import torch

    hf_config = load_hf_config(tiny_llava_dir)
    inputs = InputProcessor(tiny_llava_dir, hf_config, get_model_class(hf_config))
    items = [
        it
        for i in range(9)  # nine images: padded to the bucket of 10
        for it in inputs.process(
            {"prompt": "USER: <image>\nhi ASSISTANT:", "images": [make_test_image(60 + i)]}
        ).mm_items
    ]
    length = items[0].length
    # a step of 2 images' tokens overlaps at most 3 images: startup captures buckets 1-3
    llm = LLM(
        tiny_llava_dir,
        device="cuda",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=2 * length,
    )
    runner = llm.engine.runner
    assert runner.encoder.graphs is not None
    assert sorted(key[-1] for key in runner.encoder.graphs.graphs) == [1, 2, 3]
    moved = [runner.encoder.on_device(it) for it in items]
    eager = runner.model.get_mm_embeddings(moved)
    graphed = runner.encoder.graphs.encode(moved)  # bucket 10: captured on first use
    graphed_again = runner.encoder.graphs.encode(moved[:2])  # bucket 2: warmed at startup
    assert sorted(key[-1] for key in runner.encoder.graphs.graphs) == [1, 2, 3, 10]
    for e, g in zip(eager, graphed):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    for e, g in zip(eager, graphed_again):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert (
        graphed[0].data_ptr() != graphed_again[0].data_ptr()
    )  # outputs are copies, not the graph's buffer


def test_encoder_graphs_warmed_for_the_default_token_budget(tiny_llava_dir):
    from mmserve.core.transfer import cdiv
    from mmserve.worker.encoder_graphs import BUCKETS

    llm = LLM(tiny_llava_dir, device="cuda", dtype="float16", max_num_seqs=4)
    engine = llm.engine
    length = engine.inputs.blank_image_item().length
    most = cdiv(engine.config.scheduler.max_num_batched_tokens, length) + 1
    top = next((b for b in BUCKETS if b >= most), BUCKETS[-1])
    warmed = sorted(key[-1] for key in engine.runner.encoder.graphs.graphs)
    assert warmed == [b for b in BUCKETS if b <= top]
    llm.generate(_prompts(6), SamplingParams(max_tokens=4), use_tqdm=False)
    assert (
        sorted(key[-1] for key in engine.runner.encoder.graphs.graphs) == warmed
    )  # nothing captured on use


def test_prefill_graphs_match_eager(tiny_llava_dir):
    """First-token log-probs of single prompts (one prefill-graph replay each) and of their prefix-cache
    hits (a short chunk) equal the eager forward's; graphs pad the GEMMs' M, so up to rounding."""
    first = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompts = _prompts(5)

    def first_token_logprobs(llm):
        return [
            llm.generate([p], first, use_tqdm=False)[0].outputs[0].logprobs[0]
            for p in prompts + prompts
        ]

    want = first_token_logprobs(
        LLM(tiny_llava_dir, device="cuda", dtype="float32", enforce_eager=True)
    )
    llm = LLM(tiny_llava_dir, device="cuda", dtype="float32")
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and graphs.graphs
    replays = []
    run = graphs.run
    graphs.run = lambda *a: replays.append(len(a[0])) or run(*a)
    got = first_token_logprobs(llm)
    # every first-round prompt replays a prefill graph; a cache hit leaving one token runs the decode graph
    assert len(replays) >= len(prompts)
    assert llm.engine.kv.stats.hit_tokens > 0  # the second round hit the prefix cache
    for g, w in zip(got, want):
        common = set(g) & set(w)
        assert len(common) >= len(w) - 1  # a near-tie may swap the 5th-ranked token
        for tok in common:
            assert g[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-4)


@pytest.mark.parametrize("budget,filler", [(2048, 0), (4096, 200)])  # 4096: steps of > 2048 tokens
def test_piecewise_graphs_match_eager(tiny_llava_dir, budget, filler):
    """Steps with more than four sequences and prompt chunks among them (the first step's eight prompts,
    then decodes mixed with new prompts) replay piecewise graphs with eager attention between them; their
    tokens and log-probs equal the eager forward's up to rounding (graphs pad the GEMMs' M)."""
    # requests of different lengths, so that finished ones make room for new prompts beside decodes
    params = [
        SamplingParams(max_tokens=4 + 3 * i, min_tokens=4 + 3 * i, temperature=0.0, logprobs=3)
        for i in range(12)
    ]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=budget)
    eager = LLM(tiny_llava_dir, enforce_eager=True, **kw)
    want = eager.generate(_prompts(12, filler), params, use_tqdm=False)
    llm = LLM(tiny_llava_dir, **kw)
    pw = llm.engine.runner.piecewise_graphs
    assert pw is not None and pw.pieces
    graphs, sites, _ = pw.pieces[pw.token_buckets[-1]]
    assert len(sites) == len(pw.layers) and len(graphs) == len(sites) + 1
    replays = []
    run = pw.run
    pw.run = lambda *a: replays.append(len(a[0])) or run(*a)
    outs = llm.generate(_prompts(12, filler), params, use_tqdm=False)
    assert len(replays) >= 2 and llm.engine.kv.usage == 0
    assert pw.token_buckets[-1] == budget and (max(replays) > 2048) == (budget > 2048)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want]
    for o, w in zip(outs, want):
        for got_step, want_step in zip(o.outputs[0].logprobs, w.outputs[0].logprobs):
            for tok in set(got_step) & set(want_step):
                assert got_step[tok].logprob == pytest.approx(want_step[tok].logprob, abs=1e-4)


@pytest.mark.parametrize(
    "enforce_eager", [True, False]
)  # False: the encoder graphs captured at startup
def test_fp32_vision_encoding_does_not_depend_on_batch_size(tiny_llava_dir, enforce_eager):
    import torch

    previous = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default, which the test session turns off
    try:
        llm = LLM(tiny_llava_dir, device="cuda", dtype="float32", enforce_eager=enforce_eager)
        runner = llm.engine.runner
        items = [
            it
            for i in range(3)
            for it in llm.engine.inputs.process(
                {"prompt": "USER: <image>\nhi ASSISTANT:", "images": [make_test_image(80 + i)]}
            ).mm_items
        ]
        together = runner.encoder.encode(items)  # one batch of three
        runner.encoder.cache.clear()
        for it in items:
            alone = runner.encoder.encode([it])[it.content_hash]
            torch.testing.assert_close(alone, together[it.content_hash], rtol=1e-5, atol=1e-5)
        assert torch.backends.cudnn.allow_tf32 is True  # restored after each encode
    finally:
        torch.backends.cudnn.allow_tf32 = previous


def test_piecewise_capture_failure_closes_the_capture_and_restores_the_backends(tiny_llava_dir):
    """An exception inside the model while a piece is captured must end that capture (an open capture would
    fail every later CUDA call) and give the attention layers their backend back; the engine keeps working."""
    import torch

    from mmserve.layers.attention import Attention
    from mmserve.worker.piecewise_graphs import PiecewiseGraphs

    llm = LLM(tiny_llava_dir, device="cuda", dtype="float32", max_num_seqs=4)
    runner = llm.engine.runner
    layer = next(m for m in runner.model.modules() if isinstance(m, Attention))
    backend = layer.backend
    forward = layer.forward

    def fail_while_capturing(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("boom in capture")
        return forward(*args, **kwargs)

    layer.forward = fail_while_capturing
    hidden = runner.model.embed_input_ids(torch.zeros(1, dtype=torch.int64, device="cuda")).shape[
        -1
    ]
    graphs = PiecewiseGraphs(runner.model, runner.device, runner.dtype, hidden, [16])
    try:
        with pytest.raises(RuntimeError, match="boom in capture"):
            graphs.capture()
    finally:
        del layer.forward
    assert layer.backend is backend and not graphs.pieces
    assert torch.ones(4, device="cuda").sum().item() == 4  # no capture left open
    outs = llm.generate(_prompts(3), SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
