"""Beam search (engine/beam_search.py) against transformers' `generate(num_beams=W, early_stopping=True,
length_penalty=...)`: the same W hypotheses, best first, with and without a picture, with hypotheses that end on
the end-of-sequence id (an `end_id` the model emits early) and ones cut by max_tokens."""

from __future__ import annotations

import asyncio
import functools
import re

import pytest
import torch
import transformers

from mmserve import LLM, SamplingParams
from mmserve.engine.async_engine import AsyncEngine
from mmserve.engine.beam_search import BeamSearch, beam_search
from mmserve.testing import make_test_image

N = 10
PROMPTS = [
    ("USER: tell me a story ASSISTANT:", None),
    ("USER: <image>\nWhat is this? ASSISTANT:", 3),
]


@pytest.fixture(scope="module")
def llm(tiny_llava_dir) -> LLM:
    return LLM(tiny_llava_dir, device="cpu", dtype="float32")


@functools.lru_cache(maxsize=1)
def _hf(model_dir: str):
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    return model, transformers.AutoProcessor.from_pretrained(model_dir)


def _hf_beams(
    model_dir: str, text: str, image, width: int, length_penalty: float, eos: int
) -> list[list[int]]:
    model, processor = _hf(model_dir)
    enc = processor(text=text, images=[image] if image is not None else None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc,
            num_beams=width,
            do_sample=False,
            early_stopping=True,
            length_penalty=length_penalty,
            max_new_tokens=N,
            num_return_sequences=width,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    beams = []
    for seq in out[:, enc["input_ids"].shape[1] :].tolist():
        beams.append(seq[: seq.index(eos) + 1] if eos in seq else seq)
    return beams


@pytest.mark.parametrize("prompt", PROMPTS, ids=["text", "image"])
@pytest.mark.parametrize(
    "width,length_penalty,eos_at", [(2, 1.0, 0), (3, 0.7, 1), (3, 1.0, None), (4, 2.0, 4)]
)
def test_beams_match_transformers(tiny_llava_dir, llm, prompt, width, length_penalty, eos_at):
    text, image_seed = prompt
    image = make_test_image(image_seed) if image_seed is not None else None
    request = {"prompt": text, "images": [image] if image is not None else []}
    greedy = llm.generate([request], SamplingParams(max_tokens=N, temperature=0), use_tqdm=False)[0]
    # an end id the greedy answer reaches early, so that hypotheses finish (None: the tokenizer's, rarely reached)
    eos = greedy.outputs[0].token_ids[eos_at] if eos_at is not None else llm.engine.default_eos[0]
    engine = AsyncEngine(llm.engine)
    try:

        async def run():
            inputs = await engine.preprocess(request)
            return await beam_search(
                engine,
                inputs,
                SamplingParams(max_tokens=N, eos_token_id=eos),
                width,
                length_penalty,
                "beams",
            )

        out = asyncio.run(run())
    finally:
        engine.shutdown()
    want = _hf_beams(tiny_llava_dir, text, image, width, length_penalty, eos)
    assert [c.token_ids for c in out.outputs] == want
    assert [c.finish_reason for c in out.outputs] == [
        "stop" if b[-1] == eos else "length" for b in want
    ]
    if (width, eos_at) == (
        3,
        1,
    ):  # here a hypothesis that ended on the end id is among the best (both prompts)
        assert any(c.finish_reason == "stop" for c in out.outputs)
    for c in out.outputs:
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for e, t in zip(c.logprobs, c.token_ids))
        )
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage == 0


def test_bookkeeping_takes_eos_only_among_the_first_width_candidates():
    search = BeamSearch(2, max_tokens=5, eos_ids={9}, length_penalty=1.0)
    search.step([[(1, -0.1), (2, -0.5), (9, -0.6), (3, -0.7)]])  # 9 is third: not a hypothesis
    assert [b.tokens for b in search.running] == [[1], [2]] and not search.finished
    search.step([[(9, -0.05), (4, -1.0)], [(5, -0.1), (9, -2.0)]])  # 9 after [1] is first: finishes
    assert [b.tokens for _, b in search.finished] == [[1, 9]]
    assert [b.tokens for b in search.running] == [[2, 5], [1, 4]]
    with pytest.raises(ValueError, match="beam_width must be in"):
        BeamSearch(11, max_tokens=5, eos_ids=set())


def test_qwen2_vl_beams_extend_their_m_rope_positions(tmp_path_factory):
    """An M-RoPE family: each beam's prompt + tokens get the prompt's positions, then p + delta per token."""
    from mmserve.testing.qwen2_vl import make_qwen2_vl_checkpoint

    model_dir = str(
        make_qwen2_vl_checkpoint(tmp_path_factory.mktemp("beam_qwen2_vl"), preset="tiny", seed=0)
    )
    llm = LLM(model_dir, device="cpu", dtype="float32", block_size=4)
    text = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    image = make_test_image(0, (84, 56))
    engine = AsyncEngine(llm.engine)
    try:

        async def run():
            inputs = await engine.preprocess({"prompt": text, "images": [image]})
            assert (
                inputs.position_delta != 0
            )  # the picture's positions run ahead of the token count
            return await beam_search(
                engine, inputs, SamplingParams(max_tokens=N), 3, 0.5, "qwen-beams"
            )

        out = asyncio.run(run())
    finally:
        engine.shutdown()
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    enc = transformers.AutoProcessor.from_pretrained(model_dir)(
        text=text, images=[image], return_tensors="pt"
    )
    with torch.no_grad():
        want = model.generate(
            **enc,
            num_beams=3,
            do_sample=False,
            early_stopping=True,
            length_penalty=0.5,
            max_new_tokens=N,
            num_return_sequences=3,
        )
    assert [c.token_ids for c in out.outputs] == want[:, enc["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("family", ["mllama", "blip2_t5"])
def test_cross_attention_and_encoder_decoder_beams_match_transformers(tmp_path_factory, family):
    """Each beam request attends the picture's encoder keys/values in its own pool blocks (Mllama), or is the
    decoder prompt of an encoder-decoder (BLIP-2 Flan-T5, whose transformers output starts with the decoder's
    start id)."""
    if family == "mllama":
        from mmserve.testing.mllama import make_mllama_checkpoint as make

        preset, cls = "tiny", transformers.MllamaForConditionalGeneration
        text = "<|begin_of_text|><|image|>If I had to write a haiku for this one"
    else:
        from mmserve.testing.blip2 import make_blip2_checkpoint as make

        preset, cls = "tiny-t5", transformers.Blip2ForConditionalGeneration
        text = "Question: what is shown here? Answer:"
    model_dir = str(make(tmp_path_factory.mktemp(f"beam_{family}"), preset=preset, seed=0))
    llm = LLM(model_dir, device="cpu", dtype="float32")
    image = make_test_image(1)
    engine = AsyncEngine(llm.engine)
    try:

        async def run():
            inputs = await engine.preprocess({"prompt": text, "images": [image]})
            return await beam_search(
                engine, inputs, SamplingParams(max_tokens=8), 3, 0.5, f"{family}-beams"
            )

        out = asyncio.run(run())
    finally:
        engine.shutdown()
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc = transformers.AutoProcessor.from_pretrained(model_dir)(
        images=[image], text=text, return_tensors="pt"
    )
    with torch.no_grad():
        want = model.generate(
            **enc,
            num_beams=3,
            do_sample=False,
            early_stopping=True,
            length_penalty=0.5,
            max_new_tokens=8,
            num_return_sequences=3,
        )
    skip = 1 if family == "blip2_t5" else enc["input_ids"].shape[1]
    assert [c.token_ids for c in out.outputs] == want[:, skip:].tolist()
    cross = llm.engine.scheduler.cross_blocks
    assert llm.engine.kv.usage == 0 and (cross is None or cross.usage == 0)


def test_llm_beam_search_runs_prompts_together_as_the_engine_driver(tiny_llava_dir, llm):
    """LLM.beam_search: several prompts at once (their beam requests share steps), each the same beams as one
    alone through the driver."""
    prompts = [
        {"prompt": text, "images": [make_test_image(seed)] if seed is not None else []}
        for text, seed in PROMPTS
    ]
    outs = llm.beam_search(prompts, 3, SamplingParams(max_tokens=N), length_penalty=0.7)
    for prompt, out in zip(prompts, outs):
        [alone] = llm.beam_search(prompt, 3, SamplingParams(max_tokens=N), length_penalty=0.7)
        assert len(out.outputs) == 3 and [c.token_ids for c in out.outputs] == [
            c.token_ids for c in alone.outputs
        ]
        assert [c.text for c in out.outputs] == [c.text for c in alone.outputs]
    assert (
        llm.generate([prompts[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_stop_sequences_end_hypotheses_as_an_end_id_does(llm):
    """A one-token stop sequence picks the same beams as that token as the end id (parity-tested above against
    transformers), keeping the token in the text; one beam with a two-token stop sequence, with presence /
    frequency penalties and with a guide is the engine's own greedy answer with them (penalties count the beam's
    tokens; the guide continues past them); several beams under a guide all keep to it."""
    text = PROMPTS[0][0]
    greedy = llm.generate([text], SamplingParams(max_tokens=N, temperature=0), use_tqdm=False)[
        0
    ].outputs[0]
    tok = greedy.token_ids[1]
    never = llm.engine.default_eos[0]
    [as_eos] = llm.beam_search(text, 3, SamplingParams(max_tokens=N, eos_token_id=tok))
    [as_stop] = llm.beam_search(
        text, 3, SamplingParams(max_tokens=N, eos_token_id=never, stop_token_sequences=[[tok]])
    )
    assert [c.token_ids for c in as_stop.outputs] == [c.token_ids for c in as_eos.outputs]
    assert [c.finish_reason for c in as_stop.outputs] == [c.finish_reason for c in as_eos.outputs]
    assert any(c.finish_reason == "stop" for c in as_stop.outputs)
    for c in as_stop.outputs:  # the stop token is text; the end id is not
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    pair = greedy.token_ids[2:4]
    words = llm.tokenizer.decode(pair)
    cases = [
        ({"stop_token_sequences": [pair]}, {"stop_token_sequences": [pair]}),
        (
            {"presence_penalty": 1.5, "frequency_penalty": 0.7},
            {"presence_penalty": 1.5, "frequency_penalty": 0.7},
        ),
        # a stop string is its own tokens (TensorRT-LLM's stop_words_list)
        (
            {"stop": [words]},
            {"stop_token_sequences": [llm.tokenizer.encode(words, add_special_tokens=False)]},
        ),
        ({"guided_decoding_type": "regex", "guided_decoding_guide": "[a-z ]+"},) * 2,
    ]
    for beam_extra, greedy_extra in cases:
        [one_beam] = llm.beam_search(
            text, 1, SamplingParams(max_tokens=N, eos_token_id=never, **beam_extra)
        )
        want = llm.generate(
            [text],
            SamplingParams(max_tokens=N, eos_token_id=never, temperature=0, **greedy_extra),
            use_tqdm=False,
        )[0].outputs[0]
        assert one_beam.outputs[0].token_ids == want.token_ids, beam_extra
        assert one_beam.outputs[0].finish_reason == want.finish_reason, beam_extra
    [guided] = llm.beam_search(
        text,
        3,
        SamplingParams(max_tokens=N, guided_decoding_type="regex", guided_decoding_guide="[a-z ]+"),
    )
    assert all(re.fullmatch("[a-z ]+", c.text) for c in guided.outputs), [
        c.text for c in guided.outputs
    ]
    [one_beam] = llm.beam_search(
        text, 1, SamplingParams(max_tokens=N, eos_token_id=never, stop_token_sequences=[pair])
    )
    assert (
        one_beam.outputs[0].token_ids == greedy.token_ids[:4]
        and one_beam.outputs[0].finish_reason == "stop"
    )
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage == 0


def test_step_params_turn_penalties_over_the_beam_into_a_logit_bias():
    from mmserve.engine.beam_search import step_params

    params = SamplingParams(
        max_tokens=5,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={7: 1.0, 8: 2.0},
        stop_token_sequences=[[1, 2]],
        stop=["x"],
    )
    step = step_params(params, 2, [5, 5, 7])
    assert step.logit_bias == {5: -1.0, 7: 0.25, 8: 2.0}
    assert (
        step.presence_penalty,
        step.frequency_penalty,
        step.stop,
        step.stop_token_sequences,
    ) == (0, 0, [], [])
    assert step.max_tokens == 1 and step.logprobs == 4


def test_a_guide_prefix_must_keep_to_the_guide(llm):
    """guided_decoding_prefix (beam search's step requests) needs a guide, and its tokens must be ones the guide
    takes: otherwise a ValueError naming it, and the engine runs on."""
    with pytest.raises(ValueError, match="guided_decoding_prefix"):
        SamplingParams(guided_decoding_prefix=[1])
    digit = llm.tokenizer.encode("7", add_special_tokens=False)[0]
    params = SamplingParams(
        max_tokens=2,
        guided_decoding_type="regex",
        guided_decoding_guide="[a-z]+",
        guided_decoding_prefix=[digit],
    )
    with pytest.raises(ValueError, match="guided_decoding_prefix: token"):
        llm.generate(["hello"], params, use_tqdm=False)
    assert (
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage == 0
