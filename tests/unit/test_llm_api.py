"""The offline API end to end on the tiny LLaVA: input forms, chat, sampling options, and bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import image_to_data_uri, image_to_png_bytes, make_test_image

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llava_dir):
    return LLM(tiny_llava_dir, device="cpu", num_kv_blocks=256, block_size=8)


def _ids(llm, prompt, params=GREEDY):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def test_the_offline_api_reads_local_files_by_default(llm, tmp_path, monkeypatch):
    """In the user's own process any local path works: relative to the working directory, or absolute (the
    servers keep local files off unless --allowed-local-media-path names a directory)."""
    img = make_test_image(5)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "cat.png").write_bytes(image_to_png_bytes(img))
    monkeypatch.chdir(tmp_path / "pics")
    want = _ids(llm, {"prompt": PROMPT, "images": [img]})
    for source in ["cat.png", str(tmp_path / "pics" / "cat.png"), "../pics/cat.png"]:
        assert _ids(llm, {"prompt": PROMPT, "images": [source]}) == want
    with pytest.raises(ValueError, match="images\\[0\\]: cannot open 'missing.png'"):
        _ids(llm, {"prompt": PROMPT, "images": ["missing.png"]})


def test_every_image_source_gives_the_same_answer(llm, tmp_path):
    img = make_test_image(7)
    path = tmp_path / "img.png"
    path.write_bytes(image_to_png_bytes(img))
    llm.engine.inputs.media = type(llm.engine.inputs.media)(allowed_local_media_path=str(tmp_path))
    sources = [
        img,
        str(path),
        path,
        image_to_data_uri(img),
        image_to_png_bytes(img),
        np.asarray(img),
    ]
    answers = [_ids(llm, {"prompt": PROMPT, "images": [s]}) for s in sources]
    assert all(a == answers[0] for a in answers)


def test_text_only_prompt_and_finish_reasons(llm):
    out = llm.generate(
        "USER: hello there ASSISTANT:",
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    eos = llm.tokenizer.eos_token_id
    # forcing EOS through end_id-style override: pick the first greedy token as the "eos"
    first = out.outputs[0].token_ids[0]
    out = llm.generate(
        "USER: hello there ASSISTANT:",
        SamplingParams(max_tokens=5, temperature=0, eos_token_id=first),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].token_ids == [first] and out.outputs[0].finish_reason == "stop"
    assert eos is not None


def test_stop_string_truncates_text(llm):
    full = llm.generate({"prompt": PROMPT, "images": [make_test_image(1)]}, GREEDY, use_tqdm=False)[
        0
    ]
    text = full.outputs[0].text
    stop = text[3:6]
    assert stop and text.index(stop) == 3
    out = llm.generate(
        {"prompt": PROMPT, "images": [make_test_image(1)]},
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0]
    assert out.outputs[0].text == text[:3]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_seeded_sampling_is_reproducible_inside_any_batch(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _ids(llm, "USER: tell me a story ASSISTANT:", p)
    batch = llm.generate(
        ["USER: other ASSISTANT:", "USER: tell me a story ASSISTANT:", "USER: x ASSISTANT:"],
        [SamplingParams(max_tokens=7, temperature=1.0), p, SamplingParams(max_tokens=3)],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    assert (
        _ids(
            llm,
            "USER: tell me a story ASSISTANT:",
            SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True),
        )
        != alone
    )


def test_chat_applies_template_with_image_parts(llm):
    img = make_test_image(3)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_to_data_uri(img)}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert chat.prompt == PROMPT
    assert chat.outputs[0].token_ids == _ids(llm, {"prompt": PROMPT, "images": [img]})


def test_abort_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("x", {"prompt": PROMPT, "images": [make_test_image(2)]}, GREEDY)
    engine.step()
    assert engine.kv.usage > 0
    out = engine.abort("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.usage == 0 and not engine.has_unfinished()


@pytest.mark.parametrize(
    "prompt, error, match",
    [
        ({"prompt": PROMPT, "images": []}, ValueError, "1 <image> placeholder.*0 image"),
        (
            {"prompt": "USER: hi ASSISTANT:", "images": [make_test_image(0)]},
            ValueError,
            "0 <image> placeholder.*1 image",
        ),
        (
            {"prompt": PROMPT, "images": [b"not an image"]},
            ValueError,
            "cannot be decoded as an image",
        ),
        ({"prompt": PROMPT, "images": ["data:image/png;base64,@@@"]}, ValueError, "base64"),
        ({"prompt": "word " * 600}, ValueError, "prompt has .* tokens"),
        ({"prompt": 42}, TypeError, "prompt must be a string"),
        ({"prompt": "hi", "bogus": 1}, ValueError, "unknown prompt keys"),
    ],
)
def test_bad_input_raises_and_engine_stays_usable(llm, prompt, error, match):
    with pytest.raises(error, match=match):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage == 0
    assert len(_ids(llm, "USER: still fine? ASSISTANT:")) == GREEDY.max_tokens


def test_a_bad_prompt_among_good_ones_aborts_the_whole_call(llm):
    good = {"prompt": PROMPT, "images": [make_test_image(3)]}
    bad = {"prompt": PROMPT, "images": [b"not an image"]}
    with pytest.raises(ValueError, match="cannot be decoded as an image"):
        llm.generate([good, good, bad, good], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage == 0 and not llm.engine.requests
    assert len(_ids(llm, good)) == GREEDY.max_tokens


def test_engine_steps_while_later_prompts_are_still_preprocessed(llm, monkeypatch):
    """The first prompts run before the later ones finish preprocessing: those wait for the engine's first
    step (with a timeout, so an engine that preprocesses everything first fails instead of hanging)."""
    import threading

    stepped = threading.Event()
    waited: list[bool] = []
    process, step = llm.engine.inputs.process, llm.engine.step

    def slow_process(prompt):
        if prompt["prompt"].endswith("later ASSISTANT:"):
            waited.append(stepped.wait(timeout=10))
        return process(prompt)

    def step_and_signal():
        stepped.set()
        return step()

    monkeypatch.setattr(llm.engine.inputs, "process", slow_process)
    monkeypatch.setattr(llm.engine, "step", step_and_signal)
    prompts = [
        {"prompt": f"USER: <image>\n{word} ASSISTANT:", "images": [make_test_image(i)]}
        for i, word in enumerate(["first", "second", "later", "later"])
    ]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert waited == [True, True]
    assert [len(o.outputs[0].token_ids) for o in outs] == [GREEDY.max_tokens] * 4
    assert [o.prompt for o in outs] == [p["prompt"] for p in prompts]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 0}, "n must be an integer"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_lists_over_the_limits_raise_naming_the_flag(llm, tiny_llava_dir):
    """RequestLimits: the engine refuses a request whose lists are too long before it is queued; LLM's keyword
    arguments set the limits (checked before the model loads)."""
    many = [f"~{i:03d}" for i in range(65)]
    with pytest.raises(ValueError, match=r"^stop: 65 entries, more than --max-stop-sequences=64$"):
        llm.generate("USER: hi ASSISTANT:", SamplingParams(max_tokens=2, stop=many), use_tqdm=False)
    with pytest.raises(
        ValueError,
        match=r"^bad_token_sequences: 4097 token ids in all, more than "
        r"--max-stop-sequence-chars=4096$",
    ):
        llm.generate(
            "USER: hi ASSISTANT:",
            SamplingParams(max_tokens=2, bad_token_sequences=[[5] * 4097]),
            use_tqdm=False,
        )
    assert not llm.engine.has_unfinished() and llm.engine.kv.usage == 0
    out = llm.generate(
        "USER: hi ASSISTANT:", SamplingParams(max_tokens=2, stop=many[:64]), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids
    with pytest.raises(ValueError, match="max_stop_sequence_chars must be an integer >= 1"):
        LLM(tiny_llava_dir, device="cpu", max_stop_sequence_chars=0)


def test_bad_config_values(tiny_llava_dir, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_llava_dir, dtype="float8")
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_llava_dir, device="tpu")
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llava_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FancyVisionModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError,
        match="FancyVisionModel.*supported architectures: .*LlavaForConditionalGeneration",
    ):
        LLM(str(bad), device="cpu")


def test_non_streaming_requests_are_reported_only_when_finished(llm):
    engine = llm.engine
    engine.add_processed(
        "quiet", engine.inputs.process("USER: hi ASSISTANT:"), GREEDY, stream=False
    )
    engine.add_request("loud", "USER: hi ASSISTANT:", GREEDY)
    seen: dict[str, list[bool]] = {"quiet": [], "loud": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out.finished)
    assert seen["quiet"] == [True]
    assert len(seen["loud"]) == GREEDY.max_tokens and seen["loud"][-1]


def test_exact_repeat_of_text_and_picture_reuses_the_processed_inputs(llm):
    inputs = llm.engine.inputs
    first = inputs.process({"prompt": PROMPT, "images": [make_test_image(11)]})
    again = inputs.process({"prompt": PROMPT, "images": [image_to_png_bytes(make_test_image(11))]})
    assert again is first  # same text, same picture by content
    other = inputs.process({"prompt": PROMPT, "images": [make_test_image(12)]})
    assert other is not first and other.mm_items[0].content_hash != first.mm_items[0].content_hash
    with_id = inputs.process({"prompt": PROMPT, "images": [make_test_image(11)], "image_ids": [7]})
    assert with_id is not first and with_id.mm_items[0].content_hash == "id:7"
    outs = llm.generate(
        [{"prompt": PROMPT, "images": [make_test_image(11)]}] * 2, GREEDY, use_tqdm=False
    )
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    inputs.clear_recent()  # forgotten: the repeat runs the processor again
    fresh = inputs.process({"prompt": PROMPT, "images": [make_test_image(11)]})
    assert fresh is not first and fresh.prompt_token_ids == first.prompt_token_ids


def test_steps_over_the_host_time_limit_are_logged(llm, monkeypatch, caplog):
    from mmserve.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "SLOW_STEP_S", 1e9)
    with caplog.at_level("WARNING", logger="mmserve.engine.engine"):
        llm.generate(["USER: hello ASSISTANT:"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "slow step" not in caplog.text
    monkeypatch.setattr(engine_module, "SLOW_STEP_S", 0.0)  # every launched step is over the limit
    with caplog.at_level("WARNING", logger="mmserve.engine.engine"):
        llm.generate(["USER: hello ASSISTANT:"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert "slow step: prefill of" in caplog.text and "on the host" in caplog.text
    caplog.clear()  # the same shapes again: logged once a minute at most, saying it is not a first use
    with caplog.at_level("WARNING", logger="mmserve.engine.engine"):
        llm.generate(["USER: hello ASSISTANT:"] * 3, SamplingParams(max_tokens=8), use_tqdm=False)
    repeats = [r.message for r in caplog.records if "again for this shape" in r.message]
    assert len(repeats) <= 1 and caplog.text.count("slow step") <= 8


def test_generation_config_eos_ids_all_end_a_request(tiny_llava_dir, tmp_path):
    """Every EOS id of generation_config.json ends a request (Llama 3 instruct: <|eot_id|>, <|end_of_text|>,
    <|eom_id|>), as transformers' generate stops on each; min_tokens holds all of them back, end_id overrides."""
    prompt = {"prompt": PROMPT, "images": [make_test_image(4)]}
    free = LLM(tiny_llava_dir, device="cpu", num_kv_blocks=64, block_size=8)
    ids = _ids(free, prompt)
    third = ids[2]
    assert (
        third not in ids[:2]
        and ids[5] not in ids[:5]
        and free.tokenizer.eos_token_id not in ids[:6]
    )
    model = tmp_path / "model"
    shutil.copytree(tiny_llava_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [free.tokenizer.eos_token_id, third]
    (model / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(model), device="cpu", num_kv_blocks=64, block_size=8)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[
        0
    ].outputs[0]
    assert out.token_ids == ids[:3] and out.finish_reason == "stop" and out.stop_reason is None
    held = llm.generate(
        [prompt], SamplingParams(max_tokens=12, min_tokens=4, temperature=0.0), use_tqdm=False
    )
    assert third not in held[0].outputs[0].token_ids[:4]
    own = llm.generate(
        [prompt],
        SamplingParams(max_tokens=12, temperature=0.0, eos_token_id=ids[5]),
        use_tqdm=False,
    )
    assert own[0].outputs[0].token_ids == ids[:6]  # end_id alone ends it: the configured ids do not
