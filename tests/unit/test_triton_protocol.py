"""The Triton tensor <-> request mapping without a server: codecs, shape rules, prompt table, sampling mapping."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mmserve.core.outputs import CompletionOutput, Logprob, RequestOutput
from mmserve.entrypoints.triton import outputs as tout
from mmserve.entrypoints.triton import protocol as tp
from mmserve.entrypoints.triton.models import inputs_of, model_config_json, model_metadata
from mmserve.entrypoints.triton.prompts import build_prompt
from mmserve.entrypoints.triton.tensors import (
    check_json_value,
    deserialize_bytes,
    from_generate_value,
    from_json,
    from_raw,
    generate_shape,
    serialize_bytes,
    to_raw,
)
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.multimodal.prompt_media import aload_prompt_media
from mmserve.testing import make_test_image

STATE = SimpleNamespace(
    media=MediaConfig(),
    config=SimpleNamespace(max_batch_size=8),
    model_type="llava",
    engine=SimpleNamespace(
        model_info=SimpleNamespace(image_token="<image>", video_token=None), lora_names=lambda: []
    ),
)


def _bytes(*items: str) -> np.ndarray:
    return np.array([[s.encode() for s in items]], dtype=object)


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def parse(model="ensemble", **tensors):
    """The requests of these tensors, their pictures loaded as the engine loads them (AsyncEngine.preprocess:
    aload_prompt_media), so a bad picture fails here naming its Triton field, as it fails the request."""
    base = {"text_input": _bytes("What is this?"), "max_tokens": _scalar(8, np.int32)}
    base.update(tensors)

    async def parse_and_load():
        tensors = {k: v for k, v in base.items() if v is not None}
        reqs = await tp.parse_request(STATE, model, tensors)
        for req in reqs:
            req.prompt = await aload_prompt_media(req.prompt, STATE.media)
        return reqs

    return asyncio.run(parse_and_load())


# ---- codecs ------------------------------------------------------------------------------------------
def test_bytes_tensor_round_trips_with_uint32_length_prefixes():
    arr = np.array([b"ab", b"", "h\u00e9".encode()], dtype=object)
    raw = serialize_bytes(arr)
    assert raw[:6] == b"\x02\x00\x00\x00ab"
    assert deserialize_bytes("x", raw) == [b"ab", b"", "h\u00e9".encode()]
    assert from_raw("x", "BYTES", [1, 3], raw).tolist() == [[b"ab", b"", "h\u00e9".encode()]]
    with pytest.raises(ValueError, match="x: .*runs past"):
        deserialize_bytes("x", raw[:-1])


def test_raw_numeric_tensor_size_must_match_shape():
    arr = np.arange(6, dtype=np.float16).reshape(1, 2, 3)
    assert np.array_equal(from_raw("img", "FP16", [1, 2, 3], to_raw(arr)), arr)
    with pytest.raises(ValueError, match="img: shape \\[1, 2, 2\\] of FP16 needs 8 bytes, got 12"):
        from_raw("img", "FP16", [1, 2, 2], to_raw(arr))


def test_json_data_may_be_nested_or_flat_and_count_must_match():
    assert from_json("t", "INT32", [2, 2], [[1, 2], [3, 4]]).tolist() == [[1, 2], [3, 4]]
    assert from_json("t", "INT32", [2, 2], [1, 2, 3, 4]).dtype == np.int32
    with pytest.raises(ValueError, match="t: shape \\[2, 2\\] needs 4 elements, got 3"):
        from_json("t", "INT32", [2, 2], [1, 2, 3])


@pytest.mark.parametrize(
    "datatype,value",
    [("INT32", 16.0), ("UINT64", -1), ("INT32", 2**31), ("FP32", True), ("BYTES", 3), ("BOOL", 1)],
)
def test_json_values_are_type_checked_like_triton(datatype, value):
    with pytest.raises(ValueError, match="^max_tokens: "):
        check_json_value("max_tokens", datatype, value)


def test_generate_shape_follows_the_schema_rules():
    assert generate_shape("text_input", [-1, 1], 1) == [1, 1]
    assert generate_shape("stop_words", [-1, -1], 2) == [1, 2]
    assert generate_shape("image_url_input", [-1, -1], 3) == [1, 3]
    assert generate_shape("img", [-1, -1, -1, -1, -1], 4) == [1, 1, 1, 1, 4]
    assert generate_shape("max_tokens", [-1, 1], 2) == [2, 1]  # a batch of 2
    with pytest.raises(ValueError, match="can not convert input 'image_sizes_input'"):
        generate_shape("image_sizes_input", [-1, -1, 2], 3)
    assert from_generate_value("top_p", "FP32", (1,), 0).tolist() == [[0.0]]
    assert from_generate_value("bad_words", "BYTES", (-1,), []).size == 0
    with pytest.raises(ValueError, match="^stop_words: .*1-D"):
        from_generate_value("stop_words", "BYTES", (-1,), [["a"]])


# ---- models ------------------------------------------------------------------------------------------
def test_metadata_shapes_prepend_the_batch_dimension():
    meta = model_metadata("ensemble")
    by_name = {t["name"]: t for t in meta["inputs"]}
    assert by_name["text_input"] == {"name": "text_input", "datatype": "BYTES", "shape": [-1, 1]}
    assert by_name["image_input"]["shape"] == [-1, -1, -1, -1, -1]
    assert by_name["seed"]["datatype"] == "UINT64" and "min_length" not in by_name
    assert [o["name"] for o in meta["outputs"]] == [
        "text_output",
        "cum_log_probs",
        "output_log_probs",
        "context_logits",
        "generation_logits",
        "batch_index",
        "sequence_index",
    ]
    bls = {s.name: s for s in inputs_of("tensorrt_llm_bls")}
    assert bls["image_input"].dims == (-1, 3, -1, -1) and "exclude_input_in_output" in bls
    assert (
        "image_sizes_input" not in bls
        and model_metadata("tensorrt_llm_bls")["platform"] == "python"
    )


def test_config_json_has_proto_field_names_and_integer_dims():
    cfg = model_config_json("tensorrt_llm_bls", decoupled=True, accumulate_tokens=False)
    text = next(i for i in cfg["input"] if i["name"] == "text_input")
    assert text["data_type"] == "TYPE_STRING" and text["dims"] == [1] and text["optional"] is False
    # the server passes --max-num-seqs; its default is 64
    assert cfg["max_batch_size"] == 64 and cfg["model_transaction_policy"] == {"decoupled": True}
    assert cfg["parameters"]["accumulate_tokens"] == {"string_value": "False"}


# ---- prompts -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_type,text,n,expected",
    [
        ("llava", "What?", 1, "USER:\n<image>What? ASSISTANT:"),
        ("llava", "What?", 0, "USER:\nWhat? ASSISTANT:"),
        ("llava", "<image>\nWhat?", 1, "USER:\n<image>\nWhat? ASSISTANT:"),
        ("llava", "USER: What? ASSISTANT:", 1, "USER:<image> What? ASSISTANT:"),
        (
            "blip2",
            "Question: which city is this? Answer:",
            1,
            "Question: which city is this? Answer:",
        ),
        ("mllama", "If I had to write a haiku", 1, "<|image|>If I had to write a haiku"),
        (
            "llava_onevision",
            "Why?",
            1,
            "<|im_start|>user <image>\nWhy?<|im_end|><|im_start|>assistant\n",
        ),
        (
            "vila",
            "<image>\n<image>\n Please",
            2,
            "A chat between a curious user and an artificial intelligence "
            "assistant. The assistant gives helpful, detailed, and polite answers to the user's questions. USER: "
            "<image>\n<image>\n Please ASSISTANT:",
        ),
        (
            "qwen2_vl",
            "Hi",
            1,
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
            "<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n",
        ),
    ],
)
def test_prompts_are_built_per_model_type(model_type, text, n, expected):
    assert build_prompt(model_type, text, n) == expected


def test_own_model_name_keeps_the_text_as_the_prompt():
    assert (
        build_prompt("llava", "USER: <image>\nHi ASSISTANT:", 1, wrap=False)
        == "USER: <image>\nHi ASSISTANT:"
    )
    assert build_prompt("llava", "Hi", 1, wrap=False) == "<image>Hi"


def test_placeholder_count_must_match_images_and_video_needs_a_video_family():
    with pytest.raises(ValueError, match="^text_input: the text has 2 <image> placeholder"):
        build_prompt("llava", "<image><image>Hi", 1)
    with pytest.raises(
        ValueError, match="video_bytes_input: video input is not supported by model type llava"
    ):
        build_prompt("llava", "Hi", 0, num_videos=1)
    assert "<video>" in build_prompt("llava_onevision", "Why?", 0, num_videos=1)


# ---- tensors -> requests ---------------------------------------------------------------------------------
def test_sampling_inputs_map_to_sampling_params_with_trtllm_conventions():
    [req] = parse(
        top_p=_scalar(0.0, np.float32),
        top_k=_scalar(0, np.int32),
        end_id=_scalar(-1, np.int32),
        pad_id=_scalar(1, np.int32),
        min_length=_scalar(3, np.int32),
        random_seed=_scalar(2**63 + 5, np.uint64),
        temperature=_scalar(0.5, np.float32),
        stop_words=_bytes("foo", ""),
        bad_words=_bytes("bar"),
        return_log_probs=_scalar(True, bool),
        stream=_scalar(True, bool),
    )
    p = req.params
    assert (p.top_p, p.top_k, p.eos_token_id, p.min_tokens, p.seed, p.temperature) == (
        1.0,
        0,
        None,
        3,
        2**63 + 5,
        0.5,
    )
    assert (
        p.stop == ["foo"]
        and p.include_stop_str_in_output
        and p.bad_words == ["bar"]
        and p.logprobs == 0
    )
    assert (
        req.stream
        and req.return_log_probs
        and req.prompt["prompt"] == "USER:\nWhat is this? ASSISTANT:"
    )
    [req] = parse(
        end_id=_scalar(7, np.int32), min_tokens=_scalar(2, np.int32), seed=_scalar(1, np.uint64)
    )
    assert (req.params.eos_token_id, req.params.min_tokens, req.params.seed) == (7, 2, 1)


@pytest.mark.parametrize(
    "tensors,field",
    [
        ({"beam_width": _scalar(11, np.int32)}, "beam_width"),
        ({"max_tokens": _scalar(0, np.int32)}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"text_input": None}, "text_input"),
        ({"max_tokens": _scalar(8.0, np.float32)}, "max_tokens"),
        ({"max_tokens": np.array([[[8]]], np.int32)}, "max_tokens"),
        ({"temperature": _scalar(-1.0, np.float32)}, "temperature"),
        ({"top_p": _scalar(1.5, np.float32)}, "top_p"),
        ({"num_return_sequences": _scalar(17, np.int32)}, "num_return_sequences must be in"),
        ({"prompt_embedding_table": np.zeros((1, 2, 2), np.float16)}, "prompt_embedding_table"),
        ({"min_length": _scalar(1, np.int32), "min_tokens": _scalar(1, np.int32)}, "min_length"),
        ({"foo": _scalar(1, np.int32)}, "'foo'"),
        ({"top_k": np.array([[1], [1]], np.int32)}, "top_k"),
        ({"text_input": np.array([[b"\xff"]], dtype=object)}, "text_input"),
        ({"text_input": np.array(b"hi", dtype=object)}, "text_input: expected shape"),
        ({"image_input": np.zeros((1, 1, 2, 4, 4), np.float16)}, "image_input"),
        ({"image_bytes_input": np.zeros((1, 4, 4, 3), np.uint8)}, "image_bytes_input"),
        ({"image_url_input": _bytes("data:image/png;base64,!!")}, "image_url_input"),
        (
            {
                "image_url_input": _bytes("x"),
                "image_bytes_input": np.zeros((1, 1, 4, 4, 3), np.uint8),
            },
            "only one of",
        ),
        ({"image_url_input": _bytes("data:image/png;base64,aGVsbG8=")}, "image_url_input"),
        ({"video_bytes_input": np.zeros((1, 2, 4, 4, 3), np.uint8)}, "video_bytes_input"),
    ],
)
def test_bad_inputs_raise_value_errors_naming_the_field(tensors, field):
    with pytest.raises(ValueError, match=field):
        parse(**tensors)


def test_image_inputs_become_prompt_images_or_pixel_values():
    img = np.asarray(make_test_image(3, size=(20, 12)))  # H=12, W=20
    [hwc] = parse(image_bytes_input=img[None, None])
    [chw] = parse(image_bytes_input=img.transpose(2, 0, 1)[None, None].copy())
    assert hwc.prompt["images"][0].size == chw.prompt["images"][0].size == (20, 12)
    assert (
        hwc.prompt["prompt"] == "USER:\n<image>What is this? ASSISTANT:"
        and hwc.image_field == "image_bytes_input"
    )
    padded = np.zeros((1, 1, 30, 30, 3), np.uint8)
    [cropped] = parse(image_bytes_input=padded, image_sizes_input=np.array([[[12, 20]]], np.int64))
    assert cropped.prompt["images"][0].size == (20, 12)
    [pre] = parse(
        image_input=np.zeros((1, 2, 3, 8, 8), np.float16),
        prompt_table_extra_id=_scalar(9, np.uint64),
    )
    assert tuple(pre.prompt["pixel_values"].shape) == (2, 3, 8, 8) and pre.prompt["image_ids"] == [
        "9.0",
        "9.1",
    ]
    assert pre.prompt["prompt"].count("<image>") == 2
    with pytest.raises(ValueError, match="prompt_table_extra_id must be >= 1"):
        parse(
            image_input=np.zeros((1, 1, 3, 8, 8), np.float16),
            prompt_table_extra_id=_scalar(0, np.uint64),
        )


def test_video_frames_go_to_families_that_take_video():
    state = SimpleNamespace(
        media=STATE.media, model_type="llava_onevision", engine=STATE.engine, config=STATE.config
    )
    frames = np.zeros((1, 4, 3, 8, 8), np.uint8)  # [B, F, C, H, W]
    [req] = asyncio.run(
        tp.parse_request(
            state,
            "ensemble",
            {
                "text_input": _bytes("Why?"),
                "max_tokens": _scalar(4, np.int32),
                "video_bytes_input": frames,
            },
        )
    )
    assert req.prompt["videos"][0].shape == (4, 8, 8, 3) and req.image_field == "video_bytes_input"
    assert req.prompt["prompt"] == "<|im_start|>user <video>\nWhy?<|im_end|><|im_start|>assistant\n"


def test_batched_tensors_give_one_request_per_item():
    reqs = parse(
        text_input=np.array([[b"a"], [b"b"]], dtype=object),
        max_tokens=np.array([[1], [2]], np.int32),
    )
    assert [r.params.max_tokens for r in reqs] == [1, 2]
    assert [r.prompt["prompt"] for r in reqs] == ["USER:\na ASSISTANT:", "USER:\nb ASSISTANT:"]
    [own] = parse(model="tiny", max_tokens=None, exclude_input_in_output=_scalar(True, bool))
    assert (
        own.prompt["prompt"] == "What is this?"
        and own.exclude_input
        and own.params.max_tokens == 16
    )


# ---- outputs -----------------------------------------------------------------------------------------
def _output(ids, logprobs=None, cum=None) -> RequestOutput:
    comp = CompletionOutput(0, "xyz", ids, cum, logprobs, "length")
    return RequestOutput("r", "p", [1, 2], [comp], True)


def test_output_tensors_have_the_seed_shapes_and_zero_placeholders():
    lps = [{5: Logprob(-0.5)}, {6: Logprob(-1.0), 9: Logprob(-0.1, 1)}]
    tensors = tout.make_outputs(
        [tout.Chunk("xyz", _output([5, 6], lps, -1.5), 0, True)], "ensemble"
    )
    assert tensors["text_output"].shape == (1,) and tensors["text_output"][0] == b"xyz"
    assert tensors["cum_log_probs"].tolist() == [[-1.5]]
    assert tensors["output_log_probs"].tolist() == [[[-0.5, -1.0]]]
    assert tensors["context_logits"].shape == (1, 1, 1) and tensors["generation_logits"].shape == (
        1,
        1,
        1,
        1,
    )
    piece = tout.make_outputs([tout.Chunk("z", _output([5, 6]), 1, False)], "tensorrt_llm_bls")
    assert piece["output_log_probs"].tolist() == [[[0.0]]] and piece["cum_log_probs"].tolist() == [
        [0.0]
    ]
    assert piece["kv_cache_alloc_total_blocks"].shape == (1, 1)
    assert list(tout.select_outputs(piece, None, "tensorrt_llm_bls")) == list(
        tout.select_outputs(tensors, None, "x")
    )
    assert list(
        tout.select_outputs(piece, ["arrival_time_ns", "text_output"], "tensorrt_llm_bls")
    ) == ["arrival_time_ns", "text_output"]
    with pytest.raises(
        ValueError, match="unexpected inference output 'arrival_time_ns' for model 'ensemble'"
    ):
        tout.select_outputs(tensors, ["arrival_time_ns"], "ensemble")


def test_full_text_puts_the_decoded_prompt_before_the_completion():
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            words = {1: "USER:", 2: "Hi", 5: "a", 6: "b"}
            return " ".join(words[i] for i in ids)

    out = _output([5, 6])
    out.outputs[0].text = "a b"
    assert tout.full_text(Tok(), out, exclude_input=False) == "USER: Hi a b"
    assert tout.full_text(Tok(), out, exclude_input=True) == "a b"


def test_errors_map_to_triton_http_statuses():
    from mmserve.engine.admission import EngineOverloaded
    from mmserve.entrypoints.state import ServerBusy

    assert [
        tp.http_status(e)
        for e in (
            tp.ModelNotFound("m"),
            ServerBusy("b"),
            EngineOverloaded("o"),
            ValueError("v"),
            RuntimeError("r"),
        )
    ] == [404, 503, 503, 400, 500]


def test_llava_next_ensemble_prompt_uses_the_mistral_instruction_format():
    from mmserve.entrypoints.triton.prompts import build_prompt

    assert build_prompt("llava_next", "What is it?", 1) == "[INST] <image>\nWhat is it? [/INST]"


def test_logits_flags_reach_sampling_params_and_logits_fill_the_outputs():
    [req] = parse(
        return_context_logits=_scalar(True, bool), return_generation_logits=_scalar(True, bool)
    )
    assert req.params.return_context_logits and req.params.return_generation_logits
    out = _output([5, 6])
    out.context_logits, out.generation_logits = torch.ones(3, 10), torch.full((2, 10), 2.0)
    other = _output([7])
    tensors = tout.make_outputs([tout.Chunk("a", out), tout.Chunk("b", other)], "ensemble")
    assert tensors["context_logits"].shape == (2, 3, 10) and tensors["generation_logits"].shape == (
        2,
        1,
        2,
        10,
    )
    assert tensors["context_logits"][0].min() == 1.0 and tensors["context_logits"][1].max() == 0.0
    assert tensors["generation_logits"][0, 0].min() == 2.0


def test_word_lists_split_ids_at_their_end_offsets() -> None:
    from mmserve.entrypoints.triton.requests import BatchItem
    from mmserve.entrypoints.triton.tokens import word_lists

    item = BatchItem({"stop_words_list": np.array([[[5, 6, 7, 0], [2, 3, -1, -1]]], np.int32)}, 0)
    assert word_lists(item, "stop_words_list") == [[5, 6], [7]]
    assert word_lists(BatchItem({}, 0), "stop_words_list") == []
    for bad in (
        [[5, 6], [3, -1]],
        [[5, 6], [2, 1]],
        [[5, -6], [2, -1]],
    ):  # past the ids, decreasing, negative
        with pytest.raises(ValueError, match="bad_words_list"):
            word_lists(
                BatchItem({"bad_words_list": np.array([bad], np.int32)}, 0), "bad_words_list"
            )


def test_token_sequences_are_validated_by_name() -> None:
    from mmserve.sampling_params import SamplingParams

    assert SamplingParams(stop_token_sequences=[(1, 2)]).stop_token_sequences == [[1, 2]]
    for field in ("stop_token_sequences", "bad_token_sequences"):
        for value in ([[]], [[1, -2]], [["a"]]):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: value})
