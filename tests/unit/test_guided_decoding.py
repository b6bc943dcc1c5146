"""Guided decoding (engine/guided.py, xgrammar): outputs that follow a regex, a JSON schema, any JSON or an EBNF
grammar, greedy or sampled, beside unguided requests in one batch; the sampler masks exactly what the grammar
disallows; bad guides are refused naming the field."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.worker.sampler import Sampler
from mmserve.worker.sampling_batch import SamplingBatch

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
PROMPT = "USER: describe it ASSISTANT:"


@pytest.fixture(scope="module")
def llm(tiny_llava_dir) -> LLM:
    return LLM(tiny_llava_dir, device="cpu", dtype="float32")


def _guided(kind: str, guide: str | None, **kw) -> SamplingParams:
    return SamplingParams(
        **{"max_tokens": 48, **kw}, guided_decoding_type=kind, guided_decoding_guide=guide
    )


def test_outputs_follow_their_guides_beside_free_requests(llm):
    params = [
        _guided("regex", "(yes|no|maybe)", temperature=0.0),
        _guided("regex", "[0-9]{3}-[a-z]{2}", temperature=1.0, seed=5),
        _guided("json_schema", json.dumps(SCHEMA), temperature=0.0),
        _guided("json_schema", json.dumps(SCHEMA), temperature=1.0, seed=7),
        _guided("ebnf_grammar", 'root ::= "(" [a-c]+ ")"', temperature=0.0, max_tokens=6),
        SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0),
    ]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    assert outs[0].text in ("yes", "no", "maybe") and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[1].text) and outs[1].finish_reason == "stop"
    for out in outs[2:4]:
        value = json.loads(out.text)
        assert (
            set(value) == {"ok", "color"}
            and isinstance(value["ok"], bool)
            and value["color"] in SCHEMA["properties"]["color"]["enum"]
        )
    # a grammar that never ends by itself: cut by max_tokens, every token inside the grammar
    assert re.fullmatch(r"\(([a-c]+\)?)?", outs[4].text) and len(outs[4].token_ids) <= 6
    free = llm.generate([PROMPT], params[5], use_tqdm=False)[0].outputs[0]
    assert (
        outs[5].token_ids == free.token_ids
    )  # the unguided row is untouched by its neighbours' grammars


def test_any_json_and_async_scheduling_give_the_same_answer(tiny_llava_dir, llm):
    params = _guided("json", None, temperature=0.0, max_tokens=24)
    got = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert got.text[:1] in "[{"
    sync = LLM(tiny_llava_dir, device="cpu", dtype="float32", async_scheduling=False)
    assert sync.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == got.token_ids


def test_logprobs_of_a_guided_row_cover_only_allowed_tokens(llm):
    out = llm.generate(
        [PROMPT], _guided("regex", "(yes|no)", temperature=0.0, logprobs=5), use_tqdm=False
    )[0]
    first = out.outputs[0].logprobs[0]
    finite = {tok for tok, lp in first.items() if lp.logprob > float("-inf")}
    allowed = {llm.tokenizer.decode([t]) for t in finite}
    assert allowed and all(a and ("yes".startswith(a) or "no".startswith(a)) for a in allowed)
    assert sum(torch.tensor([lp.logprob for lp in first.values()]).exp()).item() == pytest.approx(
        1.0, abs=1e-4
    )


def test_sampler_masks_what_the_matcher_disallows(llm):
    guide = llm.engine.grammars.guide("regex", "ab")
    vocab = llm.engine.text_config.vocab_size
    a, b = llm.tokenizer.convert_tokens_to_ids(["a", "b"])
    logits = torch.zeros(2, vocab + 8)  # a padded head; row 1 free
    logits[:, b] = 5.0
    batch = SamplingBatch.build(
        [SamplingParams(temperature=0.0)] * 2,
        [[], []],
        [[], []],
        [None, None],
        [(), ()],
        [[], []],
        vocab + 8,
        torch.device("cpu"),
        grammars=[guide, None],
    )
    assert batch.guided_rows.tolist() == [0]
    out = Sampler(fused=False)(logits, batch)
    assert out.token_ids.tolist()[1] == b
    assert llm.tokenizer.decode([out.token_ids.tolist()[0]]) in ("a", "ab")


def test_bad_guides_are_refused_naming_the_field(llm):
    with pytest.raises(ValueError, match="guided_decoding_guide: not a valid regex guide"):
        llm.generate([PROMPT], _guided("regex", "(unclosed"), use_tqdm=False)
    with pytest.raises(ValueError, match="guided_decoding_guide: not a valid json_schema guide"):
        llm.generate([PROMPT], _guided("json_schema", "{not json"), use_tqdm=False)
    with pytest.raises(ValueError, match="guided_decoding_type must be one of"):
        _guided("xml", "<a/>")
    with pytest.raises(ValueError, match="guided_decoding_guide must be given"):
        _guided("regex", None)
    assert not llm.engine.has_unfinished()
