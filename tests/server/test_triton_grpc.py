"""Triton gRPC against a real `mmserve serve`: tritonclient.grpc infer and decoupled stream_infer the way the
seed's multimodal client uses them (image_input FP16 from the HF processor, image_bytes_input raw pixels)."""

from __future__ import annotations

import queue
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from transformers import AutoProcessor
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image

TEXT = "Question: which city is this? Answer:"


@pytest.fixture(scope="module")
def offline(tiny_llava_dir):
    return LLM(tiny_llava_dir, device="cpu")


@pytest.fixture(scope="module")
def client(server):
    return grpcclient.InferenceServerClient(server.grpc_url)


def completion(offline, prompt: dict, **params) -> tuple[str, str]:
    """(completion, text_output with the prompt) of the offline engine."""
    out = offline.generate(
        prompt, SamplingParams(include_stop_str_in_output=True, **params), use_tqdm=False
    )[0]
    text = out.outputs[0].text
    return text, offline.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True) + text


def inputs(**arrays: np.ndarray) -> list[grpcclient.InferInput]:
    result = []
    for name, arr in arrays.items():
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        result.append(inp)
    return result


def seed_inputs(
    image_name: str, image: np.ndarray, max_tokens: int = 16, stream: bool = False, **extra
):
    """The seed client's tensors, in its order, for --model_type llava."""
    return inputs(
        text_input=np.array([[TEXT.encode()]], dtype=object),
        **{image_name: image},
        max_tokens=np.array([[max_tokens]], np.int32),
        beam_width=np.array([[1]], np.int32),
        temperature=np.array([[1.0]], np.float32),
        end_id=np.array([[-1]], np.int32),
        pad_id=np.array([[1]], np.int32),
        top_k=np.array([[1]], np.int32),
        top_p=np.array([[0.0]], np.float32),
        stream=np.array([[stream]]),
        repetition_penalty=np.array([[1.0]], np.float32),
        **extra,
    )


def run_stream(
    client, requests: list[tuple[str, list, str]], outputs=("text_output",), **kw
) -> list[tuple]:
    """Send (model, inputs, id) requests on one stream; returns (result, error) in arrival order."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    for model, tensors, request_id in requests:
        client.async_stream_infer(
            model,
            tensors,
            request_id=request_id,
            outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
            **kw,
        )
    client.stop_stream()  # half-closes and blocks until the server has answered everything
    return [results.get() for _ in range(results.qsize())]


def final_flag(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_seed_client_image_input_fp16_from_the_hf_processor(client, offline, tiny_llava_dir, model):
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    pixels = processor(text="<image>", images=[make_test_image(5)], return_tensors="pt")[
        "pixel_values"
    ]
    image = pixels.numpy().astype(np.float16)[None]  # [1, 1, 3, 42, 42]
    result = client.infer(
        model,
        seed_inputs("image_input", image),
        outputs=[grpcclient.InferRequestedOutput("text_output")],
    )
    _, want = completion(
        offline,
        {
            "prompt": f"USER:\n<image>{TEXT} ASSISTANT:",
            "pixel_values": torch.from_numpy(image[0].astype(np.float32)),
        },
        max_tokens=16,
        top_k=1,
    )
    text = result.as_numpy("text_output")
    assert text.shape == (1,) and text[0].decode() == want
    assert [o.name for o in result.get_response().outputs] == ["text_output"]


def test_image_bytes_input_with_prompt_table_extra_id(client, offline):
    image = np.asarray(make_test_image(6, size=(30, 20)))[None, None]  # [1, 1, H, W, 3] uint8
    _, want = completion(
        offline,
        {"prompt": f"USER:\n<image>{TEXT} ASSISTANT:", "images": [make_test_image(6, (30, 20))]},
        max_tokens=16,
        top_k=1,
    )
    for extra in ({}, {"prompt_table_extra_id": np.array([[77]], np.uint64)}):
        result = client.infer("ensemble", seed_inputs("image_bytes_input", image, **extra))
        assert result.as_numpy("text_output")[0].decode() == want
        assert result.as_numpy("cum_log_probs").shape == (1, 1)
        assert result.get_response().parameters["sequence_id"].int64_param == 0
    chw = np.ascontiguousarray(image.transpose(0, 1, 4, 2, 3))  # [1, 1, 3, H, W]
    assert (
        client.infer("ensemble", seed_inputs("image_bytes_input", chw))
        .as_numpy("text_output")[0]
        .decode()
        == want
    )


def test_stream_infer_sends_pieces_then_a_final_response(client, offline):
    image = np.asarray(make_test_image(8))[None, None]
    want, _ = completion(
        offline,
        {"prompt": f"USER:\n<image>{TEXT} ASSISTANT:", "images": [make_test_image(8)]},
        max_tokens=12,
        min_tokens=12,
        top_k=1,
    )
    answers = run_stream(
        client,
        [
            (
                "ensemble",
                seed_inputs(
                    "image_bytes_input", image, 12, True, min_tokens=np.array([[12]], np.int32)
                ),
                "s1",
            )
        ],
    )
    assert all(error is None for _, error in answers)
    results = [r for r, _ in answers]
    assert len(results) >= 3 and [final_flag(r) for r in results] == [False] * (
        len(results) - 1
    ) + [True]
    assert "".join(r.as_numpy("text_output")[0].decode() for r in results) == want
    assert all(r.get_response().id == "s1" for r in results)
    plain = run_stream(
        client,
        [
            (
                "ensemble",
                seed_inputs(
                    "image_bytes_input", image, 12, False, min_tokens=np.array([[12]], np.int32)
                ),
                "s2",
            )
        ],
    )
    [(result, error)] = plain  # stream=false: one response with the whole text, prompt included
    assert (
        error is None
        and final_flag(result)
        and result.as_numpy("text_output")[0].decode().endswith(want)
    )


def test_streamed_sampled_sequences_carry_their_sequence_index(client, offline):
    """num_return_sequences 3 with stream over gRPC: each response one sequence's new text and its sequence_index;
    each sequence's pieces join to the one-sequence request seeded seed + i; only the last response is final."""
    tensors = inputs(
        text_input=np.array([[b"USER: tell me a story ASSISTANT:"]], dtype=object),
        max_tokens=np.array([[6]], np.int32),
        temperature=np.array([[1.0]], np.float32),
        random_seed=np.array([[5]], np.uint64),
        num_return_sequences=np.array([[3]], np.int32),
        exclude_input_in_output=np.array([[True]]),
        stream=np.array([[True]]),
    )
    answers = run_stream(
        client,
        [("tensorrt_llm_bls", tensors, "n3")],
        outputs=("text_output", "sequence_index"),
        enable_empty_final_response=True,
    )
    assert all(error is None for _, error in answers)
    pieces = {0: "", 1: "", 2: ""}
    for result, _ in answers[:-1]:
        pieces[int(result.as_numpy("sequence_index")[0, 0])] += result.as_numpy("text_output")[
            0
        ].decode()
    want = [
        completion(
            offline,
            {"prompt": "USER: tell me a story ASSISTANT:"},
            max_tokens=6,
            temperature=1.0,
            seed=5 + i,
        )[0]
        for i in range(3)
    ]
    assert [pieces[i] for i in range(3)] == want and len(set(want)) > 1
    assert [final_flag(r) for r, _ in answers] == [False] * (len(answers) - 1) + [True]


def test_bls_stream_sends_a_flag_only_final_only_when_asked(client):
    tensors = inputs(
        text_input=np.array([[b"hello"]], dtype=object),
        max_tokens=np.array([[6]], np.int32),
        min_tokens=np.array([[6]], np.int32),
        temperature=np.array([[0.0]], np.float32),
        stream=np.array([[True]]),
    )
    quiet = run_stream(client, [("tensorrt_llm_bls", tensors, "q")])
    assert quiet and not any(final_flag(r) for r, _ in quiet)
    loud = run_stream(
        client, [("tensorrt_llm_bls", tensors, "l")], enable_empty_final_response=True
    )
    *data, (last, error) = loud
    assert error is None and final_flag(last) and not last.get_response().outputs
    assert [r.as_numpy("text_output")[0] for r, _ in data] == [
        r.as_numpy("text_output")[0] for r, _ in quiet
    ]


def test_concurrent_requests_and_in_band_errors_share_one_stream(client):
    def req(text: str, max_tokens: int):
        return inputs(
            text_input=np.array([[text.encode()]], dtype=object),
            max_tokens=np.array([[max_tokens]], np.int32),
            temperature=np.array([[0.0]], np.float32),
            stream=np.array([[True]]),
            exclude_input_in_output=np.array([[True]]),
        )

    expect = {
        rid: client.infer("tensorrt_llm_bls", req(text, 8)).as_numpy("text_output")[0].decode()
        for rid, text in (("a", "one"), ("b", "two"))
    }
    answers = run_stream(
        client,
        [
            ("ensemble", req("one", 8), "a"),
            ("ensemble", req("x", 0), "bad"),
            ("ensemble", req("two", 8), "b"),
        ],
    )
    errors = [e for _, e in answers if e is not None]
    assert len(errors) == 1 and "max_tokens" in errors[0].message()
    for rid, want in expect.items():
        pieces = [r for r, e in answers if e is None and r.get_response().id == rid]
        assert "".join(
            r.as_numpy("text_output")[0].decode() for r in pieces
        ) == want and final_flag(pieces[-1])


def test_metadata_config_and_index_over_grpc(client, server):
    assert (
        client.is_server_live() and client.is_server_ready() and client.is_model_ready("ensemble")
    )
    assert not client.is_model_ready("nope")
    meta = client.get_model_metadata("ensemble", as_json=True)
    inputs_ = {t["name"]: (t["datatype"], [int(d) for d in t["shape"]]) for t in meta["inputs"]}
    assert inputs_["image_bytes_input"] == ("UINT8", [-1, -1, -1, -1, -1])
    assert inputs_["image_url_input"] == ("BYTES", [-1, -1]) and inputs_["stream"] == (
        "BOOL",
        [-1, 1],
    )
    assert meta["platform"] == "ensemble" and meta["versions"] == ["1"]
    config = client.get_model_config("tensorrt_llm_bls").config
    # --max-num-seqs, default 64
    assert config.max_batch_size == 64 and config.model_transaction_policy.decoupled
    assert {i.name: list(i.dims) for i in config.input}["image_input"] == [-1, 3, -1, -1]
    names = {m.name for m in client.get_model_repository_index().models}
    assert names == {
        "ensemble",
        "tensorrt_llm_bls",
        "tensorrt_llm",
        "preprocessing",
        "multimodal_encoders",
        "postprocessing",
        Path(server.model_dir).name,
    }
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert "NOT_FOUND" in err.value.status() and "nope" in err.value.message()


def test_typed_contents_are_accepted_and_outputs_come_as_raw_contents(server):
    request = service_pb2.ModelInferRequest(model_name="tensorrt_llm_bls", id="typed")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    text.contents.bytes_contents.append(b"hello")
    tokens = request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    tokens.contents.int_contents.append(4)
    flag = request.inputs.add(name="exclude_input_in_output", datatype="BOOL", shape=[1, 1])
    flag.contents.bool_contents.append(True)
    with grpc.insecure_channel(server.grpc_url) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request)
    assert (
        response.id == "typed" and len(response.raw_output_contents) == len(response.outputs) == 7
    )
    assert [o.name for o in response.outputs][0] == "text_output" and list(
        response.outputs[0].shape
    ) == [1]
