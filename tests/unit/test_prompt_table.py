"""Prompt tables (multimodal/prompt_table.py): a client's own visual features, given as rows that prompt ids from
the vocabulary size on stand for, generate exactly what the picture they were computed from generates."""

from __future__ import annotations

import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"


@pytest.fixture(scope="module")
def llm(tiny_llava_dir):
    return LLM(tiny_llava_dir, device="cpu")


def table_prompt(llm, image) -> tuple[list[int], torch.Tensor]:
    """The picture's prompt ids with its placeholder run replaced by ids V, V+1, ..., and its embeddings."""
    engine = llm.engine
    processed = engine.inputs.process({"prompt": PROMPT, "images": [image]})
    [item] = processed.mm_items
    table = engine.runner.encoder.encode([item])[item.content_hash].float()
    vocab = engine.text_config.vocab_size
    ids = list(processed.prompt_token_ids)
    ids[item.offset : item.end] = range(vocab, vocab + item.length)
    return ids, table


def test_a_prompt_table_generates_what_its_picture_generates(llm):
    image = make_test_image(3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    want = llm.generate({"prompt": PROMPT, "images": [image]}, params, use_tqdm=False)[0].outputs[0]
    ids, table = table_prompt(llm, image)
    got = llm.generate({"prompt_token_ids": ids, "prompt_table": table}, params, use_tqdm=False)[
        0
    ].outputs[0]
    assert got.token_ids == want.token_ids
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-4)
    shuffled = torch.cat([table[5:], table[:5]])  # rows in another order, ids pointing at them
    moved = [
        t
        if t < llm.engine.text_config.vocab_size
        else (t - llm.engine.text_config.vocab_size - 5) % len(table)
        + llm.engine.text_config.vocab_size
        for t in ids
    ]
    again = llm.generate(
        {"prompt_token_ids": moved, "prompt_table": shuffled}, params, use_tqdm=False
    )[0]
    assert again.outputs[0].token_ids == want.token_ids
    other = llm.generate(
        {"prompt_token_ids": ids, "prompt_table": table.flip(0)}, params, use_tqdm=False
    )[0]
    assert other.outputs[0].token_ids != want.token_ids  # the rows really are read
    assert llm.engine.kv.usage == 0


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda ids, t, v: (ids, t[:, :3]), "prompt_table: expected float"),
        (lambda ids, t, v: (ids, t[:4]), "past the prompt_table"),
        (lambda ids, t, v: ([i for i in ids if i < v], t), "no id >= the vocabulary size"),
        (lambda ids, t, v: (ids, t * float("nan")), "NaN"),
    ],
)
def test_bad_tables_are_refused_by_name(llm, change, message):
    ids, table = table_prompt(llm, make_test_image(4))
    ids, table = change(ids, table, llm.engine.text_config.vocab_size)
    with pytest.raises(ValueError, match=message):
        llm.generate(
            {"prompt_token_ids": ids, "prompt_table": table},
            SamplingParams(max_tokens=2),
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="prompt_table: goes with prompt_token_ids"):
        llm.generate(
            {"prompt": "hi", "prompt_table": table}, SamplingParams(max_tokens=2), use_tqdm=False
        )


def test_families_without_prompt_embeddings_refuse_a_table(tmp_path_factory):
    from mmserve.testing.qwen2_vl import make_qwen2_vl_checkpoint

    llm = LLM(
        str(
            make_qwen2_vl_checkpoint(
                tmp_path_factory.mktemp("table_qwen2_vl"), preset="tiny", seed=0
            )
        ),
        device="cpu",
    )
    vocab = llm.engine.text_config.vocab_size
    table = torch.zeros(2, llm.engine.text_config.hidden_size)
    with pytest.raises(ValueError, match="prompt_table: not supported"):
        llm.generate(
            {"prompt_token_ids": [1, vocab, vocab + 1], "prompt_table": table},
            SamplingParams(max_tokens=2),
            use_tqdm=False,
        )


def test_client_named_tables_are_cached_by_their_ids(llm):
    """prompt_table_extra_ids (TensorRT-LLM's way of naming a table for KV reuse): the same ids reuse the cached
    blocks of the table run without hashing its rows; other ids compute it again; a length mismatch is refused."""
    ids, table = table_prompt(llm, make_test_image(6))
    vocab = llm.engine.text_config.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def run(extra_id: int):
        extra = [extra_id if t >= vocab else 0 for t in ids]
        return llm.generate(
            {"prompt_token_ids": ids, "prompt_table": table, "prompt_table_extra_ids": extra},
            params,
            use_tqdm=False,
        )[0]

    first, again, other = run(7), run(7), run(8)
    table_end = max(i for i, t in enumerate(ids) if t >= vocab) + 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == other.outputs[0].token_ids
    assert (
        again.metrics.num_cached_tokens
        >= table_end // llm.engine.kv.block_size * llm.engine.kv.block_size
    )
    assert other.metrics.num_cached_tokens < table_end
    items = llm.engine.inputs.process(
        {
            "prompt_token_ids": ids,
            "prompt_table": table.flip(0),
            "prompt_table_extra_ids": [7 if t >= vocab else 0 for t in ids],
        }
    ).mm_items
    assert items[0].content_hash.startswith(
        "table-id:7:"
    )  # named, not hashed: the client answers for it
    with pytest.raises(ValueError, match="prompt_table_extra_ids"):
        llm.generate(
            {"prompt_token_ids": ids, "prompt_table": table, "prompt_table_extra_ids": [1]},
            params,
            use_tqdm=False,
        )
