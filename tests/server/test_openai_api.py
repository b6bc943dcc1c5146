"""The OpenAI-compatible API of a real `mmserve serve`, driven by the official `openai` SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mmserve import LLM, SamplingParams
from mmserve.testing import image_to_data_uri, image_to_png_bytes, make_test_image
from tests.server.conftest import slow_server

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def offline(tiny_llava_dir) -> LLM:
    return LLM(tiny_llava_dir, device="cpu")


def _image_message(*urls: str, text: str = "What is in this picture?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_models_lists_triton_names_and_checkpoint_name(client, server):
    from pathlib import Path

    ids = [m.id for m in client.models.list()]
    assert ids == [
        "ensemble",
        "tensorrt_llm_bls",
        "tensorrt_llm",
        "preprocessing",
        "multimodal_encoders",
        "postprocessing",
        Path(server.model_dir).name,
    ]
    assert client.models.retrieve("ensemble").id == "ensemble"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_greedy_chat_with_data_uri_image_equals_offline_chat(client, offline):
    messages = _image_message(image_to_data_uri(make_test_image(1)))
    resp = client.chat.completions.create(
        model="ensemble", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    expected = offline.chat(messages, _greedy(), use_tqdm=False)[0]
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_with_image_url_and_several_images_equals_offline(client, offline, media_server):
    base, root = media_server
    (root / "oa-a.png").write_bytes(image_to_png_bytes(make_test_image(2)))
    url = f"{base}/oa-a.png"
    messages = _image_message(
        url, image_to_data_uri(make_test_image(3)), text="Compare the two pictures."
    )
    resp = client.chat.completions.create(
        model="ensemble", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    expected = offline.chat(messages, _greedy(), use_tqdm=False)[0]
    assert resp.choices[0].message.content == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_deltas_concatenate_to_the_non_streamed_content(client):
    messages = _image_message(image_to_data_uri(make_test_image(4)))
    kw = dict(model="ensemble", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    usage = chunks[-1].usage  # cached_tokens may differ: the second request hits the prefix cache
    assert chunks[-1].choices == [] and (
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.total_tokens,
    ) == (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_raw_sse_stream_is_data_events_ending_in_done(server):
    body = {
        "model": "ensemble",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.http_url}/v1/chat/completions", json=body, timeout=60
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first


def test_logprobs_have_openai_shape(client):
    resp = client.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and tok.bytes == list(tok.token.encode())
        assert len(tok.top_logprobs) == 3
        lps = [t.logprob for t in tok.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert tok.top_logprobs[0].logprob == pytest.approx(
            tok.logprob
        )  # greedy takes the top token
    plain = client.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "Hi there"}],
        max_tokens=6,
        temperature=0,
    )
    assert plain.choices[0].logprobs is None


def test_stop_string_cuts_the_output_before_it(client):
    kw = dict(
        model="ensemble",
        messages=_image_message(image_to_data_uri(make_test_image(5))),
        max_tokens=24,
        temperature=0,
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    starts = [
        i for i in range(2, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].strip()
    ]
    assert starts, f"no ASCII stop candidate in {full!r}"
    stop = full[starts[0] : starts[0] + 2]
    for value in (stop, [stop, "never-generated-string"]):
        resp = client.chat.completions.create(**kw, stop=value)
        assert resp.choices[0].message.content == full[: full.index(stop)]
        assert resp.choices[0].finish_reason == "stop"


def test_sampling_with_seed_repeats_and_extra_params_apply(client):
    kw = dict(
        model="ensemble",
        messages=[{"role": "user", "content": "Tell me"}],
        max_completion_tokens=10,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    resp = client.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "Go"}],
        max_tokens=20,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"ignore_eos": True, "min_tokens": 20},
    )
    assert resp.usage.completion_tokens == 20 and resp.choices[0].finish_reason == "length"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_bad_image_urls_are_bad_requests(client, media_server):
    base, root = media_server
    (root / "not-an-image.png").write_bytes(b"plain text, not a PNG")
    for url in (f"{base}/missing.png", f"{base}/not-an-image.png", "data:image/png;base64,!!!"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model="ensemble", messages=_image_message(url), max_tokens=2
            )
        assert err.value.body["param"] == "messages"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ],
)
def test_invalid_parameters_are_400_in_openai_error_shape(server, body, param):
    resp = httpx.post(
        f"{server.http_url}/v1/chat/completions", json={"model": "ensemble", **body}, timeout=30
    )
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_invalid_json_is_400_in_openai_error_shape(server):
    resp = httpx.post(f"{server.http_url}/v1/completions", content=b"{not json", timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_completions_plain_and_streaming_equal_offline(client, offline):
    expected = offline.generate("Once upon a time", _greedy(8), use_tqdm=False)[0]
    resp = client.completions.create(
        model="ensemble", prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert resp.object == "text_completion"
    assert resp.choices[0].text == expected.outputs[0].text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)
    chunks = list(
        client.completions.create(
            model="ensemble",
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    echoed = client.completions.create(
        model="ensemble", prompt="Once upon a time", max_tokens=8, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Once upon a time" + expected.outputs[0].text


def test_completions_logprobs_and_token_prompt(client, offline):
    ids = offline.tokenizer("Once upon a time").input_ids
    resp = client.completions.create(
        model="ensemble", prompt=ids, max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    )
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert resp.usage.prompt_tokens == len(ids)


def test_completions_echo_with_logprobs_scores_the_prompt(client, offline, server):
    """echo + logprobs (what evaluation harnesses send for log-likelihoods): the prompt's tokens come first with
    their logprobs (the first has none) and top logprobs, as the offline engine's prompt_logprobs; streamed, the
    echo chunk carries them; each of n choices repeats them."""
    text = "Once upon a time there was"
    want = offline.generate(
        {"prompt": text},
        SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    resp = client.completions.create(
        model="ensemble", prompt=text, max_tokens=3, temperature=0, logprobs=2, echo=True, n=2
    )
    p = len(want.prompt_token_ids)
    for choice in resp.choices:
        lp = choice.logprobs
        assert choice.text.startswith(text) and len(lp.tokens) == p + 3
        assert (
            lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        )
        for pos in range(1, p):
            ref = want.prompt_logprobs[pos][want.prompt_token_ids[pos]].logprob
            assert lp.token_logprobs[pos] == pytest.approx(ref, abs=1e-4)
            assert (
                2 <= len(lp.top_logprobs[pos]) <= 3
            )  # the top 2, and the prompt token when not among them
        assert lp.token_logprobs[p:] == pytest.approx(
            [
                next(iter(e.values())).logprob
                for e in offline.generate({"prompt": text}, _greedy(3, logprobs=2), use_tqdm=False)[
                    0
                ]
                .outputs[0]
                .logprobs
            ],
            abs=1e-4,
        )
    body = {
        "model": "ensemble",
        "prompt": text,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.http_url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    echo = chunks[0]["choices"][0]
    assert echo["text"] == text and len(echo["logprobs"]["tokens"]) == p
    assert echo["logprobs"]["token_logprobs"][0] is None
    assert echo["logprobs"]["token_logprobs"][1] == pytest.approx(
        want.prompt_logprobs[1][want.prompt_token_ids[1]].logprob, abs=1e-4
    )


def test_prompt_logprobs_extra_on_completions_and_chat(client, offline, server):
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank, decoded_token}} with the
    prompt token and the top k; on a completion choice and on a chat response; a 400 with stream."""
    text = "Once upon a time there was"
    want = offline.generate(
        {"prompt": text},
        SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1),
        use_tqdm=False,
    )[0]
    body = {
        "model": "ensemble",
        "prompt": text,
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": 1,
    }
    doc = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60).json()
    got = doc["choices"][0]["prompt_logprobs"]
    assert (
        len(got) == len(want.prompt_token_ids)
        and got[0] is None
        and doc["choices"][0]["logprobs"] is None
    )
    for pos in range(1, len(got)):
        tok = want.prompt_token_ids[pos]
        assert got[pos][str(tok)]["logprob"] == pytest.approx(
            want.prompt_logprobs[pos][tok].logprob, abs=1e-4
        )
        assert 1 <= len(got[pos]) <= 2 and any(e["rank"] == 1 for e in got[pos].values())
    chat = {
        "model": "ensemble",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "prompt_logprobs": 0,
    }
    doc = httpx.post(f"{server.http_url}/v1/chat/completions", json=chat, timeout=60).json()
    assert doc["prompt_logprobs"][0] is None and all(
        len(e) == 1 for e in doc["prompt_logprobs"][1:]
    )
    plain = httpx.post(
        f"{server.http_url}/v1/chat/completions", json={**chat, "prompt_logprobs": None}, timeout=60
    )
    assert "prompt_logprobs" not in plain.json()
    r = httpx.post(f"{server.http_url}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_use_beam_search_gives_the_n_best_beams_as_choices(client, offline, server):
    """vLLM's use_beam_search: the n choices are the n best beams, as LLM.beam_search finds them (completions and
    chat); options beam search cannot take yet are 400s naming them."""
    text = "Once upon a time there was"
    [want] = offline.beam_search(
        [{"prompt": text}], 3, SamplingParams(max_tokens=6), length_penalty=1.0
    )
    resp = client.completions.create(
        model="ensemble", prompt=text, max_tokens=6, n=3, extra_body={"use_beam_search": True}
    )
    assert [c.text for c in resp.choices] == [c.text for c in want.outputs]
    assert [c.index for c in resp.choices] == [0, 1, 2] and resp.usage.completion_tokens == sum(
        len(c.token_ids) for c in want.outputs
    )
    chat = client.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        n=2,
        extra_body={"use_beam_search": True},
    )
    assert len(chat.choices) == 2 and all(
        c.finish_reason in ("stop", "length") for c in chat.choices
    )
    word = offline.tokenizer.decode(want.outputs[0].token_ids[1:3])  # stop strings end beams too
    [stopped] = offline.beam_search(
        [{"prompt": text}], 3, SamplingParams(max_tokens=6, stop=[word])
    )
    resp = client.completions.create(
        model="ensemble",
        prompt=text,
        max_tokens=6,
        n=3,
        stop=[word],
        extra_body={"use_beam_search": True},
    )
    assert [c.text for c in resp.choices] == [c.text for c in stopped.outputs]
    for extra, param in (
        ({"prompt_logprobs": 2}, "prompt_logprobs"),
        ({"stream": True}, "use_beam_search"),
        ({"n": 11}, "n"),
    ):
        body = {
            "model": "ensemble",
            "prompt": text,
            "max_tokens": 4,
            "n": 2,
            "use_beam_search": True,
            **extra,
        }
        r = httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_and_detokenize(server, offline):
    """vLLM's /tokenize and /detokenize: the served tokenizer (prompt or chat messages through the template) for
    clients of the token-level tensorrt_llm model; bad input is a 400 naming the field, an unknown model a 404."""
    url = server.http_url
    text = "USER: <image>\nWhat is this? ASSISTANT:"
    doc = httpx.post(
        f"{url}/tokenize", json={"model": "ensemble", "prompt": text}, timeout=30
    ).json()
    want = offline.tokenizer(text).input_ids
    assert doc["tokens"] == want and doc["count"] == len(want) and doc["max_model_len"] > len(want)
    back = httpx.post(f"{url}/detokenize", json={"tokens": want}, timeout=30).json()["prompt"]
    assert back == offline.tokenizer.decode(want)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    rendered = offline.engine.inputs.apply_chat_template(messages)["prompt"]
    assert chat == offline.tokenizer(rendered, add_special_tokens=False).input_ids
    vocab = offline.engine.text_config.vocab_size
    for path, body, param in (
        ("/tokenize", {"prompt": "a", "messages": messages}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [vocab]}, "tokens"),
    ):
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert (
        httpx.post(f"{url}/tokenize", json={"model": "nope", "prompt": "a"}, timeout=30).status_code
        == 404
    )


@pytest.fixture
def slow_server_url(tiny_llava_dir):
    """An in-process server whose engine steps take >= 20 ms, so a long request runs for seconds."""
    with slow_server(tiny_llava_dir) as handle:
        yield handle.url, handle.engine


def _wait_until_idle(engine, since: float, what: str) -> None:
    """Wait for the engine to run nothing and hold no KV block, at most 3 s after `since` (time.monotonic())."""
    import time

    while engine.has_unfinished() or engine.kv.usage > 0:
        assert time.monotonic() - since < 3, what
        time.sleep(0.02)


def test_client_disconnect_mid_stream_aborts_the_request(slow_server_url):
    import time

    url, engine = slow_server_url
    body = {
        "model": "ensemble",
        "messages": [{"role": "user", "content": "Go on"}],
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as resp:
        events = 0
        for line in resp.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    closed = time.monotonic()
    # 400 steps of >= 20 ms would take 8 s
    _wait_until_idle(engine, closed, "the request kept running after the client went away")
    resp = httpx.post(
        f"{url}/v1/completions",
        json={"model": "ensemble", "prompt": "Hi", "max_tokens": 2},
        timeout=30,
    )
    assert resp.status_code == 200


def test_client_gone_before_a_non_streaming_answer_aborts_the_request(slow_server_url):
    import time

    url, engine = slow_server_url
    body = {"model": "ensemble", "prompt": "Go on", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    gone = time.monotonic()
    _wait_until_idle(engine, gone, "the request kept running after the client went away")


def test_client_gone_during_a_beam_search_cancels_it(slow_server_url):
    """use_beam_search: the search (one engine request per beam and step) ends with its client, slot included."""
    import time

    url, engine = slow_server_url
    body = {
        "model": "ensemble",
        "prompt": "Go on",
        "max_tokens": 300,
        "ignore_eos": True,
        "n": 2,
        "use_beam_search": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    gone = time.monotonic()
    _wait_until_idle(engine, gone, "the beam search kept running after the client went away")
    resp = httpx.post(
        f"{url}/v1/completions",
        json={"model": "ensemble", "prompt": "Hi", "max_tokens": 2},
        timeout=30,
    )
    assert resp.status_code == 200


def test_logit_bias_steers_completions_and_bad_maps_are_400(client, offline, server):
    base = offline.generate("Once upon a time", _greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    target = next(t for t in range(5, 100) if t not in base)
    resp = client.completions.create(
        model="ensemble",
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        logit_bias={str(target): 100},
    )
    want = offline.generate(
        "Once upon a time", _greedy(6, logit_bias={target: 100.0}), use_tqdm=False
    )[0]
    assert (
        want.outputs[0].token_ids == [target] * 6 and resp.choices[0].text == want.outputs[0].text
    )
    vocab = offline.engine.text_config.vocab_size
    for bias, fragment in (
        ({"x": 1}, "keys must be token ids"),
        ({"3": 101}, "must be a number in [-100, 100]"),
        ({str(vocab): 5}, "outside the vocabulary"),
    ):
        r = httpx.post(
            f"{server.http_url}/v1/chat/completions",
            timeout=30,
            json={
                "model": "ensemble",
                "messages": [{"role": "user", "content": "x"}],
                "logit_bias": bias,
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert fragment in r.json()["error"]["message"]


def test_response_format_and_guided_extras_constrain_the_output(client, offline, server):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "answer in JSON"}]
    resp = client.chat.completions.create(
        model="ensemble",
        messages=messages,
        max_tokens=20,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )
    assert isinstance(json.loads(resp.choices[0].message.content)["ok"], bool)
    regex = client.completions.create(
        model="ensemble",
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": "(yes|no)"},
    )
    assert regex.choices[0].text in ("yes", "no")
    for extra, param in (
        ({"guided_regex": "(yes"}, "guided_regex"),
        ({"guided_regex": "a", "guided_grammar": 'root ::= "b"'}, "guided_grammar"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ):
        r = httpx.post(
            f"{server.http_url}/v1/chat/completions",
            timeout=30,
            json={"model": "ensemble", "messages": messages, **extra},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
