"""OpenAI `n` on a real server: n choices fan out into n engine requests (choice i seeded seed + i) and come back
as one answer or one interleaved stream; a disconnect, a failing choice or an overload leaves nothing running."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import InProcessServer, slow_server

MAX_TOKENS = 10
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
PROMPT = "Once upon a time"
LONG = {"max_tokens": 400, "ignore_eos": True}  # 400 slow steps: seconds, unless aborted


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    )


def _create(client: openai.OpenAI, endpoint: str):
    if endpoint == "chat":
        return functools.partial(
            client.chat.completions.create,
            model="ensemble",
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
        )
    return functools.partial(
        client.completions.create, model="ensemble", prompt=PROMPT, max_tokens=MAX_TOKENS
    )


def _text(choice) -> str:
    """A whole choice's text, or a streamed choice's delta text."""
    if hasattr(choice, "message"):
        return choice.message.content
    if hasattr(choice, "delta"):
        return choice.delta.content or ""
    return choice.text


def test_n_choices_are_indexed_and_usage_counts_the_prompt_once(client):
    create = _create(client, "chat")
    resp = create(n=3, temperature=1.0, logprobs=True)
    single = create(temperature=1.0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens
    assert resp.usage.completion_tokens == sum(len(c.logprobs.content) for c in resp.choices)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_seeded_choice_i_equals_a_one_choice_request_with_seed_plus_i(client, endpoint):
    create = _create(client, endpoint)
    many = create(n=3, seed=41, temperature=1.0)
    texts = [_text(c) for c in many.choices]
    assert [_text(c) for c in create(n=3, seed=41, temperature=1.0).choices] == texts
    assert len(set(texts)) > 1, "seed + i should give the choices different samples"
    singles = [create(seed=41 + i, temperature=1.0) for i in range(3)]
    assert texts == [_text(s.choices[0]) for s in singles]
    assert [c.finish_reason for c in many.choices] == [s.choices[0].finish_reason for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_greedy_choices_are_all_the_greedy_answer(client):
    create = _create(client, "completions")
    resp = create(n=2, temperature=0)
    assert [c.text for c in resp.choices] == [create(temperature=0).choices[0].text] * 2


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_choices_interleave_and_match_the_whole_answer(client, endpoint):
    create = _create(client, endpoint)
    kw = dict(n=2, seed=5, temperature=1.0, extra_body={"ignore_eos": True})
    whole = create(**kw)
    chunks = list(create(**kw, stream=True, stream_options={"include_usage": True}))
    texts, finishes, indexes = {0: "", 1: ""}, {0: [], 1: []}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        assert not finishes[choice.index], (
            f"choice {choice.index} sent a chunk after its finish_reason"
        )
        if endpoint == "chat" and choice.index not in indexes:
            assert choice.delta.role == "assistant"
        indexes.append(choice.index)
        texts[choice.index] += _text(choice)
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert indexes != sorted(indexes), "the choices' chunks should interleave as they come"
    assert texts == {i: _text(c) for i, c in enumerate(whole.choices)}
    assert finishes == {i: [c.finish_reason] for i, c in enumerate(whole.choices)}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.total_tokens,
    ) == (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    assert usage.completion_tokens == 2 * MAX_TOKENS


@pytest.mark.parametrize("n", [0, -1, 17, True, 2.5])
@pytest.mark.parametrize(
    "route, body",
    [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": PROMPT})],
)
def test_n_outside_1_to_16_is_400_naming_n(server, route, body, n):
    resp = httpx.post(
        f"{server.http_url}{route}", json={"model": "ensemble", "n": n, **body}, timeout=30
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n"


def test_n_of_16_and_null_n_are_served(server):
    for n, expected in ((16, 16), (None, 1)):
        resp = httpx.post(
            f"{server.http_url}/v1/completions",
            timeout=60,
            json={"model": "ensemble", "prompt": PROMPT, "max_tokens": 2, "n": n},
        )
        assert resp.status_code == 200, resp.text
        assert [c["index"] for c in resp.json()["choices"]] == list(range(expected))


# ---- nothing left running: an in-process server with slow steps --------------------------------


@pytest.fixture
def cyclic_gc_off():
    """As under `mmserve serve` (its heap frozen, a high threshold), collections are rare: a choice left behind
    must not be rescued by the collector finalising its generator."""
    gc.disable()
    yield
    gc.enable()


@pytest.fixture(scope="module")
def slow(tiny_llava_dir):
    with slow_server(tiny_llava_dir) as handle:
        yield handle


def _assert_nothing_left(slow: InProcessServer, since: float) -> None:
    while slow.engine.has_unfinished() or slow.engine.kv.usage > 0 or slow.state.in_flight:
        assert time.monotonic() - since < 3, "a choice kept running after its request ended"
        time.sleep(0.02)


@pytest.mark.usefixtures("cyclic_gc_off")
def test_client_disconnect_mid_stream_aborts_every_choice(slow):
    body = {"model": "ensemble", "messages": MESSAGES, "n": 3, "stream": True, **LONG}
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json=body, timeout=30) as resp:
        seen: set[int] = set()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 3:
                assert slow.state.in_flight == 3
                break  # leaving iter_lines closes the connection
    _assert_nothing_left(slow, time.monotonic())


@pytest.mark.usefixtures("cyclic_gc_off")
def test_client_gone_before_a_non_streaming_answer_aborts_every_choice(slow):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{slow.url}/v1/completions",
            json={"model": "ensemble", "prompt": PROMPT, "n": 3, **LONG},
            timeout=0.5,
        )
    _assert_nothing_left(slow, time.monotonic())


@pytest.mark.usefixtures("cyclic_gc_off")
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "fails_after", [0, 3]
)  # 0: at its first output, once the other choices have theirs
def test_a_failing_choice_aborts_the_others_and_answers_the_error(
    slow, monkeypatch, stream, fails_after
):
    real = slow.state.generate

    async def last_choice_fails(prompt, params, request_id=None):
        async with contextlib.aclosing(real(prompt, params, request_id)) as outs:
            count = 0
            async for out in outs:
                if request_id.endswith("-2") and count == fails_after:
                    raise RuntimeError("injected failure of choice 2")
                yield out
                count += 1

    monkeypatch.setattr(slow.state, "generate", last_choice_fails)
    body = {"model": "ensemble", "prompt": PROMPT, "n": 3, "stream": stream, **LONG}
    resp = httpx.post(f"{slow.url}/v1/completions", json=body, timeout=30)
    ended = time.monotonic()
    if stream and fails_after:  # the stream had begun: the error is its last event
        events = [line for line in resp.text.splitlines() if line]
        assert resp.status_code == 200 and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
    else:
        assert resp.status_code == 500
        error = resp.json()["error"]
    assert "injected failure of choice 2" in error["message"] and error["type"] == "server_error"
    _assert_nothing_left(slow, ended)


@pytest.mark.usefixtures("cyclic_gc_off")
@pytest.mark.parametrize("stream", [False, True])
def test_a_fan_out_beyond_the_concurrency_cap_is_503_and_leaves_nothing_running(
    slow, monkeypatch, stream
):
    monkeypatch.setattr(slow.state.config, "max_concurrent_requests", 2)
    body = {"model": "ensemble", "prompt": PROMPT, "n": 3, "stream": stream, **LONG}
    resp = httpx.post(f"{slow.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "server_overloaded"
    _assert_nothing_left(slow, time.monotonic())
    ok = httpx.post(
        f"{slow.url}/v1/completions",
        json={"model": "ensemble", "prompt": PROMPT, "n": 2, "max_tokens": 2},
        timeout=30,
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
