"""Decode steps of cross-attention families (Mllama, Nougat, Deplot and BLIP-2 T5: T5's relative-position bias by
key distance in the decode kernel) replay CUDA graphs that read the cross-attention pool, with the same tokens as
their eager steps; steps a graph cannot take (text-only Mllama rows) stay eager."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from mmserve.testing.blip2 import make_blip2_checkpoint
from mmserve.testing.mllama import make_mllama_checkpoint
from mmserve.testing.nougat import make_nougat_checkpoint
from mmserve.testing.pix2struct import make_pix2struct_checkpoint

MAKERS = {
    "mllama": lambda d: make_mllama_checkpoint(d, preset="tiny", seed=0),
    "nougat": lambda d: make_nougat_checkpoint(d, preset="tiny", seed=0),
    "pix2struct": lambda d: make_pix2struct_checkpoint(d, preset="tiny", seed=0, progress=False),
    "blip2_t5": lambda d: make_blip2_checkpoint(d, preset="tiny-t5", seed=0),
}

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0, logprobs=2)


def _prompts(family: str) -> list[dict]:
    if family != "mllama":
        text = {
            "nougat": "",
            "pix2struct": "Which year?",
            "blip2_t5": "Question: what is it? Answer:",
        }[family]
        return [
            {"prompt": text, "images": [make_test_image(i, (60 + 9 * i, 80))]} for i in range(6)
        ]
    # two pictures apart (decodes attend the second's real tiles), pictures with padding tiles, a text-only prompt
    return [
        {
            "prompt": f"<|begin_of_text|><|image|> look {i}",
            "images": [make_test_image(i, (96, 40 + 20 * i))],
        }
        for i in range(4)
    ] + [
        {
            "prompt": "<|begin_of_text|><|image|> a <|image|> b",
            "images": [make_test_image(8), make_test_image(9)],
        },
        {"prompt": "<|begin_of_text|>no picture here"},
    ]


def _run(model_dir: str, family: str, **kw) -> tuple[list, LLM, list[int]]:
    llm = LLM(model_dir, device="cuda", dtype="float32", max_num_seqs=4, **kw)
    replays = []
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda *a: replays.append(len(a[0])) or run(*a)
    outs = llm.generate(_prompts(family), PARAMS, use_tqdm=False)
    assert llm.engine.kv.usage == 0
    assert llm.engine.scheduler.cross_blocks.num_free == llm.engine.runner.cross_kv.num_blocks
    return outs, llm, replays


@pytest.mark.parametrize("family", sorted(MAKERS))
def test_cross_attention_decode_graphs_match_eager(family, tmp_path):
    model_dir = str(tmp_path)
    MAKERS[family](model_dir)
    eager, _, _ = _run(model_dir, family, enforce_eager=True)
    graphed, llm, replays = _run(model_dir, family)
    assert llm.engine.runner.graphs.cross is not None and replays  # decode steps replayed graphs
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(
            a.outputs[0].cumulative_logprob, abs=1e-3
        )
