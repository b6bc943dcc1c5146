"""The token-level `tensorrt_llm` model against a real `mmserve serve`: input_ids in, output_ids out over
tritonclient HTTP and gRPC (stream_infer with streaming on), the generate extension, TensorRT-LLM's word lists and
embedding bias, beams; token for token against the offline engine. Bad inputs are 400s naming the tensor."""

from __future__ import annotations

import json
import queue
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve import LLM, SamplingParams

MODEL = "tensorrt_llm"
TEXT = "Question: which city is this? Answer:"


@pytest.fixture(scope="module")
def offline(tiny_llava_dir):
    return LLM(tiny_llava_dir, device="cpu")


@pytest.fixture(scope="module")
def http(server):
    return httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))


def prompt_ids(offline, text: str = TEXT) -> list[int]:
    return offline.tokenizer(text).input_ids


def greedy(offline, ids: list[int], n: int, **params) -> list[int]:
    out = offline.generate(
        {"prompt_token_ids": ids},
        SamplingParams(max_tokens=n, temperature=0.0, **params),
        use_tqdm=False,
    )[0]
    return out.outputs[0].token_ids


def token_tensors(
    ids_rows: list[list[int]], n: int, pad: int = 0, **extra
) -> dict[str, np.ndarray]:
    width = max(len(r) for r in ids_rows)
    ids = np.array([r + [pad] * (width - len(r)) for r in ids_rows], np.int32)
    return {
        "input_ids": ids,
        "input_lengths": np.array([[len(r)] for r in ids_rows], np.int32),
        "request_output_len": np.full((len(ids_rows), 1), n, np.int32),
        "runtime_top_k": np.ones((len(ids_rows), 1), np.int32),
        **extra,
    }


def http_infer(client, tensors: dict[str, np.ndarray], outputs=("output_ids", "sequence_length")):
    inputs = []
    for name, arr in tensors.items():
        inp = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr, binary_data=True)
        inputs.append(inp)
    result = client.infer(
        MODEL, inputs, outputs=[httpclient.InferRequestedOutput(o) for o in outputs]
    )
    return {o: result.as_numpy(o) for o in outputs}


def word_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's [1, 2, L] layout: ids end to end, then end offsets padded with -1."""
    flat = [t for w in words for t in w]
    ends = list(np.cumsum([len(w) for w in words]))
    return np.array([[flat, ends + [-1] * (len(flat) - len(ends))]], np.int32)


def test_output_ids_start_with_the_prompt_and_match_offline_greedy(http, offline):
    ids = prompt_ids(offline)
    want = greedy(offline, ids, 8)
    got = http_infer(http, token_tensors([ids], 8))
    assert got["output_ids"].shape == (1, 1, len(ids) + len(want))
    assert got["output_ids"][0, 0].tolist() == ids + want
    assert got["sequence_length"].tolist() == [[len(ids) + len(want)]]
    alone = http_infer(http, token_tensors([ids], 8, exclude_input_in_output=np.array([[True]])))
    assert alone["output_ids"][0, 0].tolist() == want and alone["sequence_length"].tolist() == [
        [len(want)]
    ]


def test_batch_of_padded_prompts_each_matches_its_own_run(http, offline):
    rows = [prompt_ids(offline), prompt_ids(offline, "USER: hello there ASSISTANT:")]
    pad = 7
    got = http_infer(
        http,
        token_tensors(
            rows,
            6,
            pad=pad,
            pad_id=np.array([[pad], [pad]], np.int32),
            exclude_input_in_output=np.array([[True], [True]]),
        ),
    )
    for i, ids in enumerate(rows):
        want = greedy(offline, ids, 6)
        assert got["output_ids"][i, 0, : len(want)].tolist() == want
        assert got["sequence_length"][i, 0] == len(want)
        assert (got["output_ids"][i, 0, len(want) :] == pad).all()


def test_stop_and_bad_word_lists_and_embedding_bias(http, offline):
    ids = prompt_ids(offline)
    want = greedy(offline, ids, 10, ignore_eos=True)
    never = [t for t in range(5, 100) if t not in want][
        :2
    ]  # ids greedy decoding does not produce here
    end_id = np.array([[never[1]]], np.int32)  # so this end_id decodes as ignore_eos does
    stop = want[3:5]  # a two-token stop sequence: the output ends with it, kept in
    got = http_infer(
        http,
        token_tensors(
            [ids],
            10,
            exclude_input_in_output=np.array([[True]]),
            end_id=end_id,
            stop_words_list=word_list([[never[0]], stop]),
        ),
    )
    first = next(i for i in range(len(stop), len(want) + 1) if want[i - len(stop) : i] == stop)
    assert got["output_ids"][0, 0].tolist() == want[:first]
    banned = http_infer(
        http,
        token_tensors(
            [ids],
            3,
            exclude_input_in_output=np.array([[True]]),
            bad_words_list=word_list([[want[0]]]),
            end_id=end_id,
        ),
    )
    assert banned["output_ids"][0, 0, 0] != want[0]
    assert banned["output_ids"][0, 0].tolist() == greedy(
        offline, ids, 3, bad_token_sequences=[[want[0]]], eos_token_id=never[1]
    )
    vocab = offline.engine.text_config.vocab_size
    bias = np.zeros((1, vocab), np.float32)
    target = (want[0] + 1) % vocab
    bias[0, target] = 1e4
    biased = http_infer(
        http,
        token_tensors(
            [ids],
            4,
            exclude_input_in_output=np.array([[True]]),
            embedding_bias=bias,
            end_id=np.array([[(target + 1) % vocab]], np.int32),
        ),
    )
    assert biased["output_ids"][0, 0].tolist() == [target] * 4


def test_generate_extension_takes_json_token_lists(server, offline):
    ids = prompt_ids(offline)
    want = greedy(offline, ids, 5)
    body = {
        "input_ids": ids,
        "input_lengths": len(ids),
        "request_output_len": 5,
        "runtime_top_k": 1,
        "exclude_input_in_output": True,
        "return_log_probs": True,
    }
    doc = httpx.post(f"{server.http_url}/v2/models/{MODEL}/generate", json=body, timeout=60).json()
    assert doc["output_ids"] == want and doc["sequence_length"] == len(want)
    assert len(doc["output_log_probs"]) == len(want) and doc["cum_log_probs"] < 0
    assert "text_output" not in doc and doc["model_name"] == MODEL


def test_grpc_streaming_sends_new_ids_per_response(server, offline):
    ids = prompt_ids(offline)
    want = greedy(offline, ids, 10, min_tokens=10)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    tensors = token_tensors(
        [ids], 10, streaming=np.array([[True]]), min_tokens=np.array([[10]], np.int32)
    )
    inputs = []
    for name, arr in tensors.items():
        inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(
        MODEL, inputs, request_id="t1", outputs=[grpcclient.InferRequestedOutput("output_ids")]
    )
    client.stop_stream()
    answers = [results.get() for _ in range(results.qsize())]
    assert all(error is None for _, error in answers) and len(answers) >= 3
    pieces = [r.as_numpy("output_ids")[0, 0].tolist() for r, _ in answers]
    assert [t for p in pieces for t in p] == want  # streaming: only the new ids, never the prompt


def test_beams_come_as_output_ids_rows(http, offline):
    ids = prompt_ids(offline)
    [beamed] = offline.beam_search(
        [{"prompt_token_ids": ids}], 2, SamplingParams(max_tokens=5, ignore_eos=True)
    )
    got = http_infer(
        http,
        token_tensors(
            [ids],
            5,
            beam_width=np.array([[2]], np.int32),
            exclude_input_in_output=np.array([[True]]),
        ),
    )
    assert got["output_ids"].shape[:2] == (1, 2)
    for k, comp in enumerate(beamed.outputs):
        assert got["output_ids"][0, k, : len(comp.token_ids)].tolist() == comp.token_ids
        assert got["sequence_length"][0, k] == len(comp.token_ids)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"input_lengths": np.array([[500]], np.int32)}, "input_lengths"),
        (
            {
                "input_ids": np.array([[1, 2, 10**8]], np.int32),
                "input_lengths": np.array([[3]], np.int32),
            },
            "input_ids",
        ),
        ({"request_output_len": np.array([[0]], np.int32)}, "request_output_len"),
        ({"stop_words_list": np.array([[[5, 6], [3, -1]]], np.int32)}, "stop_words_list"),
        ({"embedding_bias": np.zeros((1, 3), np.float32)}, "embedding_bias"),
        ({"runtime_top_k": np.array([[-5]], np.int32)}, "runtime_top_k"),
        ({"prompt_embedding_table": np.zeros((1, 2, 4), np.float16)}, "prompt_embedding_table"),
        ({"text_input": np.array([[b"hi"]], dtype=object)}, "text_input"),
    ],
)
def test_bad_inputs_are_400s_naming_the_tensor(http, offline, change, field):
    tensors = token_tensors([prompt_ids(offline)], 4)
    tensors.update(change)
    with pytest.raises(InferenceServerException) as err:
        http_infer(http, tensors)
    assert err.value.status() == "400" and field in err.value.message()
    missing = {k: v for k, v in token_tensors([prompt_ids(offline)], 4).items() if k != "input_ids"}
    with pytest.raises(InferenceServerException, match="input_ids is required"):
        http_infer(http, missing)
    assert (
        http_infer(http, token_tensors([prompt_ids(offline)], 2))["sequence_length"][0, 0] > 0
    )  # still serving


def test_metadata_and_config_describe_the_token_model(http):
    meta = http.get_model_metadata(MODEL)
    names = {t["name"]: t for t in meta["inputs"]}
    assert meta["platform"] == "tensorrtllm" and {
        "input_ids",
        "input_lengths",
        "request_output_len",
    } <= set(names)
    assert names["stop_words_list"]["shape"] == [-1, 2, -1]
    assert [t["name"] for t in meta["outputs"]][:2] == ["output_ids", "sequence_length"]
    config = http.get_model_config(MODEL)
    # --max-num-seqs, default 64
    assert config["backend"] == "tensorrtllm" and config["max_batch_size"] == 64
    assert MODEL in [m["name"] for m in http.get_model_repository_index()]


def test_prompt_embedding_table_carries_a_pictures_features(http, offline):
    """Visual features sent as TensorRT-LLM sends them to this model: ids from the vocabulary size on stand for
    prompt_embedding_table rows (FP16); the answer is the offline engine's for the same rows."""
    from mmserve.testing import make_test_image

    engine = offline.engine
    processed = engine.inputs.process(
        {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "images": [make_test_image(5)]}
    )
    [item] = processed.mm_items
    table = engine.runner.encoder.encode([item])[item.content_hash].half()
    vocab = engine.text_config.vocab_size
    ids = list(processed.prompt_token_ids)
    ids[item.offset : item.end] = range(vocab, vocab + item.length)
    want = (
        offline.generate(
            {"prompt_token_ids": ids, "prompt_table": table.float()},
            SamplingParams(max_tokens=8, temperature=0.0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
    )
    got = http_infer(
        http,
        token_tensors(
            [ids],
            8,
            exclude_input_in_output=np.array([[True]]),
            prompt_embedding_table=table.numpy()[None],
            prompt_vocab_size=np.array([[len(table)]], np.int32),
        ),
    )
    assert got["output_ids"][0, 0].tolist() == want
    extra = np.array(
        [[5 if t >= vocab else 0 for t in ids]], np.uint64
    )  # the client names the table
    named = http_infer(
        http,
        token_tensors(
            [ids],
            8,
            exclude_input_in_output=np.array([[True]]),
            prompt_embedding_table=table.numpy()[None],
            prompt_table_extra_ids=extra,
        ),
    )
    assert named["output_ids"][0, 0].tolist() == want
    for change, field in (
        ({"prompt_vocab_size": np.array([[3]], np.int32)}, "prompt_vocab_size"),
        ({"input_ids": np.array([ids[:-1] + [vocab + len(table)]], np.int32)}, "input_ids"),
    ):
        tensors = token_tensors([ids], 2, prompt_embedding_table=table.numpy()[None])
        tensors.update(change)
        with pytest.raises(InferenceServerException) as err:
            http_infer(http, tensors)
        assert err.value.status() == "400" and field in err.value.message()


@pytest.mark.parametrize(
    "beam_width,num_return", [(1, 1), (2, 2), (1, 2)], ids=["one", "beams", "sampled"]
)
def test_stop_cancels_the_requests_sent_under_its_id(
    tiny_llava_dir, offline, beam_width, num_return
):
    """TensorRT-LLM's cancel: a request with `stop` true and the id of a running one ends it (its stream ends
    with what it has, the blocks are freed) and is answered with no tokens; other ids run on. A beam search ends
    after its step in flight, with the beams it has; streamed sampled sequences all end."""
    from tests.server.conftest import slow_server

    ids = prompt_ids(offline)
    long = {
        "input_ids": ids,
        "input_lengths": len(ids),
        "request_output_len": 300,
        "min_tokens": 300,
        "runtime_top_k": 1,
        "streaming": True,
        "beam_width": beam_width,
        "num_return_sequences": num_return,
    }
    stop = {
        "input_ids": [0],
        "input_lengths": 0,
        "request_output_len": 0,
        "stop": True,
    }  # the client's placeholders
    with slow_server(tiny_llava_dir) as handle, httpx.Client(timeout=60) as client:
        url = f"{handle.url}/v2/models/{MODEL}"
        with client.stream("POST", f"{url}/generate_stream", json={**long, "id": "r1"}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            other = client.post(f"{url}/generate", json={**stop, "id": "nobody"}).json()
            assert other["sequence_length"] == 0 and handle.engine.requests  # r1 still runs
            if (
                num_return > 1 and beam_width == 1
            ):  # a stop sent from the same template, streamed: still a stop
                body = {**stop, "id": "r1", "num_return_sequences": num_return, "streaming": True}
                with client.stream("POST", f"{url}/generate_stream", json=body) as r:
                    [answer] = [
                        json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")
                    ]
            else:
                answer = client.post(f"{url}/generate", json={**stop, "id": "r1"}).json()
            assert answer["sequence_length"] == 0 and answer["output_ids"] == []
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert 1 + len(events) < 300  # ended early, with a final event
        if (
            beam_width > 1
        ):  # the last event carries whole beams (flattened), each shorter than asked
            lengths = events[-1]["sequence_length"]
            assert len(lengths) == beam_width and all(0 < n < 300 for n in lengths)
            assert len(events[-1]["output_ids"]) == sum(lengths)
        if num_return > 1 and beam_width == 1:  # both sequences streamed, and both ended early
            assert {e["sequence_index"] for e in events} == {0, 1} and len(events) < 2 * 299
        deadline = time.time() + 5
        while (
            handle.engine.requests or handle.engine.kv.usage or handle.state.in_flight
        ) and time.time() < deadline:
            time.sleep(0.05)
        assert (
            not handle.engine.requests
            and handle.engine.kv.usage == 0
            and not handle.state.by_client_id
        )
        assert handle.state.in_flight == 0


def test_disconnect_mid_stream_aborts_every_sampled_sequence(tiny_llava_dir, offline):
    """Streamed num_return_sequences: a client that goes away mid-stream ends all N engine requests; their blocks
    and server slots come back."""
    from tests.server.conftest import slow_server

    body = {
        "text_input": "USER: tell me a long story ASSISTANT:",
        "max_tokens": 300,
        "min_tokens": 300,
        "temperature": 1.0,
        "num_return_sequences": 3,
        "stream": True,
    }
    with slow_server(tiny_llava_dir) as handle, httpx.Client(timeout=60) as client:
        url = f"{handle.url}/v2/models/tensorrt_llm_bls/generate_stream"
        with client.stream("POST", url, json=body) as r:
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.add(json.loads(line[6:])["sequence_index"])
                    if len(seen) == 3:
                        break
            assert len(handle.engine.requests) == 3
        deadline = time.time() + 5
        while (
            handle.engine.requests or handle.engine.kv.usage or handle.state.in_flight
        ) and time.time() < deadline:
            time.sleep(0.05)
        assert (
            not handle.engine.requests
            and handle.engine.kv.usage == 0
            and handle.state.in_flight == 0
        )
