"""OpenAI request models and the pure parts of `n`: content parts map onto the InputProcessor's chat format, `n`
is checked, choices get their seeds, usage counts the prompt once, and merged streams interleave and close."""

from __future__ import annotations

import asyncio

import pydantic
import pytest

from mmserve.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mmserve.entrypoints.openai.protocol import ChatMessage, CompletionRequest
from mmserve.entrypoints.openai.requests import MAX_CHOICES, num_choices
from mmserve.entrypoints.openai.responses import OpenAIError, usage_of
from mmserve.entrypoints.streams import merge
from mmserve.sampling_params import SamplingParams, choice_params


def test_text_image_and_video_parts_become_template_parts():
    msg = ChatMessage.model_validate(
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                {"type": "image_url", "image_url": "http://127.0.0.1/x.png"},
                {"type": "text", "text": "compare"},
            ],
        }
    )
    assert msg.to_template()["content"] == [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}},
        {"type": "text", "text": "compare"},
    ]


def test_unknown_part_type_is_rejected():
    with pytest.raises(pydantic.ValidationError):
        ChatMessage.model_validate(
            {"role": "user", "content": [{"type": "audio_url", "audio_url": "x"}]}
        )


@pytest.mark.parametrize("n, expected", [(None, 1), (1, 1), (MAX_CHOICES, MAX_CHOICES)])
def test_n_from_1_to_max_choices_is_accepted(n, expected):
    assert num_choices(CompletionRequest(model="m", prompt="x", n=n)) == expected


@pytest.mark.parametrize("n", [0, -3, MAX_CHOICES + 1])
def test_n_out_of_range_is_a_400_naming_n(n):
    with pytest.raises(OpenAIError) as err:
        num_choices(CompletionRequest(model="m", prompt="x", n=n))
    assert err.value.status == 400 and err.value.param == "n"


@pytest.mark.parametrize("n", [True, 2.5, "3"])
def test_n_that_is_not_an_integer_is_rejected(n):
    with pytest.raises(pydantic.ValidationError) as err:
        CompletionRequest(model="m", prompt="x", n=n)
    assert err.value.errors()[0]["loc"] == ("n",)


def test_choice_i_is_seeded_seed_plus_i_and_unseeded_choices_stay_unseeded():
    seeded = choice_params(SamplingParams(seed=100, temperature=0.7, max_tokens=5), 3)
    assert [p.seed for p in seeded] == [100, 101, 102]
    assert all(p.n == 1 and p.temperature == 0.7 and p.max_tokens == 5 for p in seeded)
    unseeded = choice_params(SamplingParams(), 2)
    assert [p.seed for p in unseeded] == [None, None] and unseeded[0] is not unseeded[1]


def _output(prompt_len: int, tokens: int, cached: int) -> RequestOutput:
    return RequestOutput(
        "r",
        None,
        list(range(prompt_len)),
        [CompletionOutput(0, "", list(range(tokens)))],
        True,
        RequestMetrics(0.0, num_cached_tokens=cached),
    )


def test_usage_counts_the_prompt_once_and_sums_the_choices():
    usage = usage_of([_output(7, 3, 0), _output(7, 5, 7), _output(7, 1, 7)])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 9, 16)
    assert (
        usage.prompt_tokens_details.cached_tokens == 0
    )  # the prompt was computed once, by one choice


async def _items(name: str, delays: list[float], log: list[str], fail_at: int | None = None):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            if i == fail_at:
                raise ValueError(f"{name} failed")
            yield f"{name}{i}"
    finally:
        log.append(f"{name} closed")


def test_merge_interleaves_items_as_they_come():
    async def run():
        log: list[str] = []
        merged = merge([_items("a", [0.0, 0.1, 0.1], log), _items("b", [0.05, 0.1], log)])
        return [item async for item in merged], log

    items, log = asyncio.run(run())
    assert items == ["a0", "b0", "a1", "b1", "a2"]
    assert sorted(log) == ["a closed", "b closed"]


def test_merge_raises_the_first_error_after_closing_the_other_streams():
    async def run():
        log: list[str] = []
        merged = merge([_items("a", [0.0, 10.0], log), _items("b", [0.0, 0.01], log, fail_at=1)])
        items = []
        with pytest.raises(ValueError, match="b failed"):
            async for item in merged:
                items.append(item)
        return items, log

    items, log = asyncio.run(asyncio.wait_for(run(), 5))
    assert items == ["a0", "b0"] and sorted(log) == ["a closed", "b closed"]


def test_closing_a_merge_early_closes_every_stream():
    async def run():
        log: list[str] = []
        merged = merge([_items("a", [0.0, 10.0], log), _items("b", [0.0, 10.0], log)])
        assert await anext(merged) == "a0"
        await merged.aclose()
        return log

    assert sorted(asyncio.run(asyncio.wait_for(run(), 5))) == ["a closed", "b closed"]


def test_guides_compile_off_the_event_loop_and_bad_ones_name_their_field():
    """A large JSON schema's first compile takes a while: it runs on a worker thread, not the server's loop."""
    import threading
    from types import MethodType, SimpleNamespace

    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.entrypoints.openai.requests import completion_params

    threads = []

    def compile_guide(kind, guide):
        threads.append(threading.current_thread())
        if "bad" in guide:
            raise ValueError(f"guided_decoding_guide: cannot compile {guide!r}")

    engine = SimpleNamespace(  # AsyncEngine's own compile_guide, over a fake Engine
        engine=SimpleNamespace(grammars=SimpleNamespace(compile=compile_guide)),
        model_info=SimpleNamespace(max_model_len=64),
    )
    engine.compile_guide = MethodType(AsyncEngine.compile_guide, engine)
    state = SimpleNamespace(engine=engine)
    params = asyncio.run(
        completion_params(CompletionRequest(model="m", prompt="x", guided_regex="[0-9]+"), state)
    )
    assert (
        params.guided_decoding_type == "regex"
        and threads
        and threads[0] is not threading.main_thread()
    )
    with pytest.raises(OpenAIError) as err:
        asyncio.run(
            completion_params(CompletionRequest(model="m", prompt="x", guided_regex="bad("), state)
        )
    assert err.value.status == 400 and err.value.param == "guided_regex"
