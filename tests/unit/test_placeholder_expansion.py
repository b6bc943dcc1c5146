"""The placeholder expansion shortcut gives exactly the HF processor's inputs, for each family whose testing
module declares the placeholder its prompts write (`FamilyCase.placeholder`)."""

from __future__ import annotations

import pytest
import torch

from mmserve.models.loader import load_hf_config
from mmserve.models.registry import get_model_class
from mmserve.multimodal.placeholder_expansion import PlaceholderExpansion, expansion_runs
from mmserve.multimodal.processors import InputProcessor
from mmserve.testing import family_cases, make_checkpoint, make_test_image

FAMILIES = {
    f: case.placeholder for f, case in family_cases().items() if case.placeholder is not None
}
# image sizes whose token counts differ (anyres, dynamic resolution) or not (LLaVA-1.5)
SIZES = [(48, 40), (40, 48), (64, 32), (48, 40)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory):
    return request.param, str(
        make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    )


def _processor(model_dir: str) -> InputProcessor:
    hf_config = load_hf_config(model_dir)
    return InputProcessor(model_dir, hf_config, get_model_class(hf_config))


def _prompts(ph: str) -> list[dict]:
    img = lambda seed, size: make_test_image(seed, size)  # noqa: E731
    return [
        {"prompt": f"USER: {ph}\nWhat is this? ASSISTANT:", "images": [img(1, SIZES[0])]},
        {"prompt": f"USER: {ph}\nand again, other words ASSISTANT:", "images": [img(2, SIZES[1])]},
        {"prompt": f"{ph} first, then {ph} second", "images": [img(3, SIZES[2]), img(4, SIZES[0])]},
        {"prompt": f"{ph}{ph} adjacent", "images": [img(5, SIZES[0]), img(6, SIZES[1])]},
        {"prompt": f"café 日本 🙂 {ph} trailing text", "images": [img(7, SIZES[3])]},
        {
            "prompt": f"{ph}",
            "images": [img(8, (33, 57))],
        },  # a size not learned yet: the processor runs
        {"prompt": f"{ph}{ph} adjacent again", "images": [img(9, SIZES[2]), img(10, SIZES[0])]},
    ]


def _same(a, b) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    assert len(a.mm_items) == len(b.mm_items)
    for x, y in zip(a.mm_items, b.mm_items):
        assert (x.modality, x.offset, x.length, x.content_hash) == (
            y.modality,
            y.offset,
            y.length,
            y.content_hash,
        )
        assert x.data.keys() == y.data.keys()
        for key in x.data:
            assert torch.equal(x.data[key], y.data[key]), key
    if a.prompt_positions is not None or b.prompt_positions is not None:
        assert (
            torch.equal(a.prompt_positions, b.prompt_positions)
            and a.position_delta == b.position_delta
        )


def test_shortcut_gives_the_processors_inputs(family_dir, monkeypatch):
    family, model_dir = family_dir
    fast, oracle = _processor(model_dir), _processor(model_dir)
    oracle._expansion = None
    assert fast._expansion is not None
    calls = []
    real_call = type(fast.processor).__call__
    monkeypatch.setattr(
        type(fast.processor),
        "__call__",
        lambda self, *a, **k: calls.append(self is fast.processor) or real_call(self, *a, **k),
    )
    prompts = _prompts(FAMILIES[family])
    for prompt in prompts:
        _same(fast.process(prompt), oracle.process(prompt))
    assert fast._expansion.verified is True
    # counts are learned per (size, images in the prompt): prompts 1-4 and 6 bring ones not seen before and
    # run the HF processor (the first also verifies the shortcut; 4's adjacent placeholders merge into one run,
    # so it teaches nothing); 5 and 7 (adjacent, the sizes of 3) take the shortcut
    assert calls.count(True) == 5, calls
    fast.clear_recent()
    calls.clear()
    _same(fast.process(prompts[0]), oracle.process(prompts[0]))
    assert calls.count(True) == 0


def test_runs_of_placeholders():
    assert expansion_runs([1, 9, 9, 2, 9, 3, 9, 9, 9], frozenset({9})) == [(9, 9), (9,), (9, 9, 9)]
    assert expansion_runs([1, 9, 9, 8, 9, 9, 7, 2, 9, 7], frozenset({7, 8, 9})) == [
        (9, 9, 8, 9, 9, 7),
        (9, 7),
    ]
    assert expansion_runs([1, 2], frozenset({9})) == []


class _Tokenizer:
    """Splits on spaces; 'IMG' is id 9, other words their length."""

    def __call__(self, text):
        return type("Enc", (), {"input_ids": [9 if w == "IMG" else len(w) for w in text.split()]})()


def _enc(ids: list[int], **extra) -> dict:
    t = torch.tensor([ids])
    return {
        "input_ids": t,
        "attention_mask": torch.ones_like(t),
        "pixel_values": torch.zeros(1, 3, 2, 2),
        **extra,
    }


def test_verified_against_the_first_run_then_expands():
    exp = PlaceholderExpansion(_Tokenizer(), 9)
    assert exp.expansions_for([(4, 4)]) is None
    exp.learn(
        [(4, 4)],
        _enc([2, 9, 9, 9, 5]),
        "ab IMG hello",
        lambda: {"pixel_values": torch.zeros(1, 3, 2, 2)},
    )
    assert exp.verified is True and exp.expansions_for([(4, 4)]) == [(9, 9, 9)]
    assert exp.expansions_for([(5, 4)]) is None
    enc = exp.encode(
        "IMG xyz IMG", [(9, 9, 9)] * 2, lambda: {"pixel_values": torch.ones(2, 3, 2, 2)}
    )
    assert enc["input_ids"].tolist() == [[9, 9, 9, 3, 9, 9, 9]]
    ran = []
    assert (
        exp.encode("no image here", [(9, 9, 9)], lambda: ran.append(1) or {}) is None
    )  # one per image
    assert ran == []  # ... and the image processor is not run for nothing


@pytest.mark.parametrize(
    "enc, outputs, text",
    [
        (
            _enc([2, 9, 9, 5], image_sizes=torch.tensor([[4, 4]])),
            {"pixel_values": torch.zeros(1, 3, 2, 2)},
            "ab IMG hello",
        ),
        (_enc([2, 9, 9, 5]), {"pixel_values": torch.ones(1, 3, 2, 2)}, "ab IMG hello"),
        (_enc([2, 9, 9, 5]), {"pixel_values": torch.zeros(1, 3, 2, 2)}, "abc IMG hello"),
    ],
    ids=["extra-key", "pixels-differ", "tokens-differ"],
)
def test_any_difference_from_the_processor_turns_it_off(enc, outputs, text):
    exp = PlaceholderExpansion(_Tokenizer(), 9)
    exp.learn([(4, 4)], enc, text, lambda: outputs)
    assert exp.verified is False and exp.expansions_for([(4, 4)]) is None
    exp.learn(
        [(4, 4)],
        _enc([2, 9, 9, 5]),
        "ab IMG hello",
        lambda: {"pixel_values": torch.zeros(1, 3, 2, 2)},
    )
    assert exp.verified is False  # off for good


def test_one_size_with_two_counts_turns_it_off():
    exp = PlaceholderExpansion(_Tokenizer(), 9)
    ok = {"pixel_values": torch.zeros(1, 3, 2, 2)}
    exp.learn([(4, 4)], _enc([2, 9, 9, 5]), "ab IMG hello", lambda: ok)
    assert exp.verified is True
    exp.learn([(4, 4)], _enc([2, 9, 9, 9, 5]), "ab IMG hello", lambda: ok)
    assert exp.verified is False and exp.expansions_for([(4, 4)]) is None


def test_another_question_on_a_recent_picture_reuses_the_image_processors_outputs(
    family_dir, monkeypatch
):
    family, model_dir = family_dir
    ph = FAMILIES[family]
    fast, oracle = _processor(model_dir), _processor(model_dir)
    oracle._expansion = None
    first = {
        "prompt": f"USER: {ph}\nWhat is this? ASSISTANT:",
        "images": [make_test_image(21, SIZES[0])],
    }
    _same(fast.process(first), oracle.process(first))
    _same(
        fast.process(first | {"prompt": f"{ph} warm"}),
        oracle.process(first | {"prompt": f"{ph} warm"}),
    )
    calls = []
    image_processor = type(fast.processor.image_processor)
    real_call = image_processor.__call__
    monkeypatch.setattr(
        image_processor,
        "__call__",
        lambda self, *a, **k: (
            calls.append(self is fast.processor.image_processor) or real_call(self, *a, **k)
        ),
    )
    # the same picture (a new object, same content) with new text, and with a client-given id
    for prompt in (
        {
            "prompt": f"USER: {ph}\nAnd its colour? ASSISTANT:",
            "images": [make_test_image(21, SIZES[0])],
        },
        {"prompt": f"{ph} once more", "images": [make_test_image(21, SIZES[0])], "image_ids": [7]},
    ):
        _same(fast.process(prompt), oracle.process(prompt))
    assert calls.count(True) == 0, calls
    other = {
        "prompt": f"USER: {ph}\nAnd its colour? ASSISTANT:",
        "images": [make_test_image(22, SIZES[0])],
    }
    _same(fast.process(other), oracle.process(other))
    assert calls.count(True) == 1, calls
