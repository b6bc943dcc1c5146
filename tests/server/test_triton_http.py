"""Triton HTTP against a real `mmserve serve`: tritonclient.http (JSON and binary tensors), the seed's curl
requests to /generate and /generate_stream, metadata/config/ready/index; greedy text equals the offline LLM."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import np_to_triton_dtype

from mmserve import LLM, SamplingParams
from mmserve.testing import image_to_data_uri, make_test_image

QUESTION = "What is in the picture?"
SEED_KEYS = [
    "batch_index",
    "context_logits",
    "cum_log_probs",
    "generation_logits",
    "id",
    "model_name",
    "model_version",
    "output_log_probs",
    "sequence_end",
    "sequence_id",
    "sequence_index",
    "sequence_start",
    "text_output",
]


@pytest.fixture(scope="module")
def offline(tiny_llava_dir):
    return LLM(tiny_llava_dir, device="cpu")


def expected(offline, prompt: dict, **params):
    out = offline.generate(
        prompt, SamplingParams(include_stop_str_in_output=True, **params), use_tqdm=False
    )[0]
    with_prompt = (
        offline.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=True)
        + out.outputs[0].text
    )
    return out, with_prompt


@pytest.fixture(scope="module")
def image_url(media_server):
    base, root = media_server
    make_test_image(7).save(Path(root) / "seven.png")
    return f"{base}/seven.png"


def infer_input(name: str, arr: np.ndarray, binary: bool) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def seed_tensors(text: str, max_tokens: int) -> dict[str, np.ndarray]:
    """What the seed client always sends (its defaults), minus the image tensor."""
    return {
        "text_input": np.array([[text.encode()]], dtype=object),
        "max_tokens": np.array([[max_tokens]], np.int32),
        "beam_width": np.array([[1]], np.int32),
        "temperature": np.array([[1.0]], np.float32),
        "end_id": np.array([[-1]], np.int32),
        "pad_id": np.array([[1]], np.int32),
        "top_k": np.array([[1]], np.int32),
        "top_p": np.array([[0.0]], np.float32),
        "stream": np.array([[False]]),
        "repetition_penalty": np.array([[1.0]], np.float32),
    }


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_infer_matches_offline_greedy(server, offline, image_url, binary):
    tensors = dict(
        seed_tensors(QUESTION, 12), image_url_input=np.array([[image_url.encode()]], dtype=object)
    )
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    result = client.infer(
        "ensemble",
        [infer_input(k, v, binary) for k, v in tensors.items()],
        outputs=[httpclient.InferRequestedOutput("text_output", binary_data=binary)],
    )
    _, want = expected(
        offline,
        {"prompt": f"USER:\n<image>{QUESTION} ASSISTANT:", "images": [make_test_image(7)]},
        max_tokens=12,
        top_k=1,
    )
    text = result.as_numpy("text_output")
    value = text[0].decode() if binary else text[0]  # JSON outputs come back as str, as from Triton
    assert text.shape == (1,) and value == want
    response = result.get_response()
    [entry] = response["outputs"]
    assert ("binary_data_size" in entry.get("parameters", {})) is binary and (
        "data" in entry
    ) is not binary
    assert response["parameters"] == {
        "sequence_id": 0,
        "sequence_start": False,
        "sequence_end": False,
    }


def test_http_infer_batch_logprobs_and_gzip(server, offline):
    texts = ["a cat", "a dog"]
    tensors = {
        "text_input": np.array([[t.encode()] for t in texts], dtype=object),
        "max_tokens": np.array([[5], [5]], np.int32),
        "temperature": np.array([[0.0], [0.0]], np.float32),
        "return_log_probs": np.array([[True], [True]]),
    }
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    result = client.infer(
        "tensorrt_llm_bls",
        [infer_input(k, v, True) for k, v in tensors.items()],
        request_compression_algorithm="gzip",
    )
    assert result.as_numpy("text_output").shape == (2,)
    for i, text in enumerate(texts):
        out, want = expected(
            offline,
            {"prompt": f"USER:\n{text} ASSISTANT:"},
            max_tokens=5,
            temperature=0.0,
            logprobs=0,
        )
        assert result.as_numpy("text_output")[i].decode() == want
        assert result.as_numpy("cum_log_probs")[i, 0] == pytest.approx(
            out.outputs[0].cumulative_logprob, abs=1e-3
        )
        got = result.as_numpy("output_log_probs")[i, 0, : len(out.outputs[0].token_ids)]
        assert got.tolist() == pytest.approx(
            [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
            abs=1e-3,
        )
    assert "parameters" not in result.get_response()  # only the ensemble has sequence parameters


def _seed_curl_body(source: str) -> dict:
    return {
        "id": "42",
        "text_input": "<|image|>If I had to write a haiku for this one",
        "image_url_input": source,
        "parameters": {
            "max_tokens": 16,
            "beam_width": 1,
            "end_id": 128001,
            "pad_id": 128004,
            "top_k": 1,
            "top_p": 0,
            "stream": False,
            "temperature": 0,
        },
    }


@pytest.mark.parametrize("kind", ["url", "data_uri"])
def test_seed_curl_request_on_generate_and_generate_stream(server, offline, image_url, kind):
    if kind == "url":
        source, image = image_url, make_test_image(7)
    else:  # the seed's documented form: data:image/jpeg;base64,...
        source = image_to_data_uri(make_test_image(7), "jpeg")
        image = base64.b64decode(source.split(",", 1)[1])
    _, want = expected(
        offline,
        {
            "prompt": "USER:\n<image><|image|>If I had to write a haiku for this one ASSISTANT:",
            "images": [image],
        },
        max_tokens=16,
        temperature=0.0,
        top_k=1,
        eos_token_id=128001,
    )
    r = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        json=_seed_curl_body(source),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.text.startswith("data: ") and r.text.endswith("\n\n") and r.text.count("data: ") == 1
    payload = r.text[len("data: ") : -2]
    event = json.loads(payload)
    assert list(event) == SEED_KEYS and payload.startswith('{"batch_index":0,"context_logits":0.0,')
    assert (
        event["id"] == "42" and event["model_name"] == "ensemble" and event["text_output"] == want
    )
    assert event["output_log_probs"] == [0.0] * 16 and event["sequence_id"] == 0
    plain = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate", json=_seed_curl_body(source), timeout=60
    )
    assert plain.headers["content-type"] == "application/json" and plain.json() == event


def test_generate_stream_pieces_concatenate_to_the_completion(server):
    body = {
        "text_input": QUESTION,
        "max_tokens": 10,
        "min_tokens": 10,
        "temperature": 0,
        "image_url_input": image_to_data_uri(make_test_image(2)),
    }
    whole = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate",
        json={**body, "exclude_input_in_output": True},
        timeout=60,
    ).json()["text_output"]
    r = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate_stream",
        json={**body, "stream": True},
        timeout=60,
    )
    events = [json.loads(chunk[len("data: ") :]) for chunk in r.text.split("\n\n") if chunk]
    assert len(events) >= 3 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == whole and len(whole) > 0
    assert not any(
        e["text_output"].startswith("USER:") for e in events
    )  # pieces carry only new text


def test_generate_accepts_a_batch_of_json_arrays(server, offline):
    r = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate",
        json={"text_input": ["a cat", "a dog"], "max_tokens": [4, 4], "temperature": [0, 0]},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    wants = [
        expected(offline, {"prompt": f"USER:\n{t} ASSISTANT:"}, max_tokens=4, temperature=0.0)[1]
        for t in ("a cat", "a dog")
    ]
    assert r.json()["text_output"] == wants and r.json()["batch_index"] == [0, 1]


def test_own_model_name_takes_the_text_as_the_whole_prompt(server, offline):
    name = Path(server.model_dir).name
    prompt = "USER: <image>\nWhat is this? ASSISTANT:"
    r = httpx.post(
        f"{server.http_url}/v2/models/{name}/versions/1/generate",
        json={
            "text_input": prompt,
            "image_url_input": image_to_data_uri(make_test_image(4)),
            "parameters": {"max_tokens": 8, "temperature": 0, "exclude_input_in_output": True},
        },
    )
    out, _ = expected(
        offline, {"prompt": prompt, "images": [make_test_image(4)]}, max_tokens=8, temperature=0.0
    )
    assert r.status_code == 200 and r.json()["text_output"] == out.outputs[0].text
    assert r.json()["model_name"] == name and "sequence_id" not in r.json()


def test_metadata_config_ready_and_repository_index(server):
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    assert (
        client.is_server_live() and client.is_server_ready() and client.is_model_ready("ensemble")
    )
    assert not client.is_model_ready("nope") and client.is_model_ready("tensorrt_llm_bls", "1")
    meta = client.get_model_metadata("ensemble")
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]}
    assert inputs["text_input"] == ("BYTES", [-1, 1]) and inputs["max_tokens"] == ("INT32", [-1, 1])
    assert inputs["image_input"] == ("FP16", [-1, -1, -1, -1, -1]) and inputs["seed"] == (
        "UINT64",
        [-1, 1],
    )
    assert inputs["prompt_table_extra_id"] == ("UINT64", [-1, 1]) and meta["platform"] == "ensemble"
    outputs = {t["name"]: (t["datatype"], t["shape"]) for t in meta["outputs"]}
    assert outputs["text_output"] == ("BYTES", [-1, -1]) and outputs["output_log_probs"] == (
        "FP32",
        [-1, -1, -1],
    )
    config = client.get_model_config("tensorrt_llm_bls")
    image = next(i for i in config["input"] if i["name"] == "image_input")
    assert (
        image["dims"] == [-1, 3, -1, -1]
        and image["data_type"] == "TYPE_FP16"
        and config["backend"] == "python"
    )
    assert "kv_cache_reused_blocks" in {o["name"] for o in config["output"]}
    index = client.get_model_repository_index()
    assert {m["name"] for m in index} == {
        "ensemble",
        "tensorrt_llm_bls",
        "tensorrt_llm",
        "preprocessing",
        "multimodal_encoders",
        "postprocessing",
        Path(server.model_dir).name,
    }
    assert all(m["state"] == "READY" and m["version"] == "1" for m in index)
    assert client.get_server_metadata()["extensions"]
    assert httpx.get(f"{server.http_url}/v2/models/ensemble/versions/2").status_code == 404
    assert httpx.get(f"{server.http_url}/v2/models/ensemble/generate").status_code == 405


def test_context_and_generation_logits_over_http_infer(server, offline, image_url):
    tensors = dict(
        seed_tensors(QUESTION, 4),
        image_url_input=np.array([[image_url.encode()]], dtype=object),
        return_context_logits=np.array([[True]]),
        return_generation_logits=np.array([[True]]),
    )
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    result = client.infer("ensemble", [infer_input(k, v, True) for k, v in tensors.items()])
    out = offline.generate(
        {"prompt": f"USER:\n<image>{QUESTION} ASSISTANT:", "images": [make_test_image(7)]},
        SamplingParams(
            max_tokens=4, top_k=1, return_context_logits=True, return_generation_logits=True
        ),
        use_tqdm=False,
    )[0]
    context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    assert context.shape == (1, len(out.prompt_token_ids), out.context_logits.shape[1])
    assert generation.shape == (1, 1, 4, out.generation_logits.shape[1])
    np.testing.assert_allclose(context[0], out.context_logits.numpy(), atol=1e-3, rtol=1e-3)
    np.testing.assert_allclose(
        generation[0, 0], out.generation_logits.numpy(), atol=1e-3, rtol=1e-3
    )


def test_embedding_bias_words_add_their_weights_to_their_tokens_logits(server, offline):
    """TensorRT-LLM's embedding bias: every id of each word's tokenization (special tokens included) gets its
    weight added; the answer equals an offline request with that logit_bias, and differs from the plain one."""
    text, words, weights = "USER: tell me a story ASSISTANT:", ["castle", "dragon"], [30.0, -5.0]
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights):
        for tok in offline.tokenizer.encode(word):
            bias[tok] = bias.get(tok, 0.0) + weight
    params = SamplingParams(max_tokens=8, temperature=0, include_stop_str_in_output=True)
    want = (
        offline.generate(
            [{"prompt": text}],
            SamplingParams(**{**vars(params), "logit_bias": bias}),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    plain = offline.generate([{"prompt": text}], params, use_tqdm=False)[0].outputs[0].text
    assert want != plain
    url = f"{server.http_url}/v2/models/tensorrt_llm_bls/generate"
    body = {
        "text_input": text,
        "max_tokens": 8,
        "temperature": 0,
        "exclude_input_in_output": True,
        "embedding_bias_words": words,
        "embedding_bias_weights": weights,
    }
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] == want, r.text
    r = httpx.post(url, json={**body, "embedding_bias_weights": [1.0]}, timeout=60)
    assert (
        r.status_code == 400
        and "embedding_bias_weights: 1 values for 2 embedding_bias_words" in r.text
    )


def test_guided_decoding_follows_the_guide_and_bad_guides_are_400(server, offline):
    """TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide on tensorrt_llm_bls: the answer follows the
    regex and equals the offline request with that guide; an unknown type or a broken guide is a 400 naming it."""
    text = "USER: pick a color ASSISTANT:"
    url = f"{server.http_url}/v2/models/tensorrt_llm_bls/generate"
    body = {
        "text_input": text,
        "max_tokens": 16,
        "temperature": 0,
        "exclude_input_in_output": True,
        "guided_decoding_guide_type": "regex",
        "guided_decoding_guide": "(red|green|blue)!",
    }
    r = httpx.post(url, json=body, timeout=60)
    guided = SamplingParams(
        max_tokens=16,
        temperature=0,
        guided_decoding_type="regex",
        guided_decoding_guide="(red|green|blue)!",
    )
    want = offline.generate([{"prompt": text}], guided, use_tqdm=False)[0].outputs[0].text
    assert r.status_code == 200 and r.json()["text_output"] == want, r.text
    assert want in ("red!", "green!", "blue!")
    for change, fragment in (
        ({"guided_decoding_guide_type": "xml"}, "guided_decoding_guide_type must be one of"),
        ({"guided_decoding_guide": "(red"}, "guided_decoding_guide: not a valid regex guide"),
        ({"guided_decoding_guide": ""}, "guided_decoding_guide: needed"),
    ):
        r = httpx.post(url, json={**body, **change}, timeout=60)
        assert r.status_code == 400 and fragment in r.json()["error"], r.text


def test_beam_width_returns_every_beam_best_first(server, offline):
    """beam_width 3 over tritonclient: text_output holds the three beams (prompt included, as the seeds' ensemble
    answers), cum_log_probs [1, 3] and output_log_probs [1, 3, tokens] their log-probs; they are what
    engine/beam_search.py gives offline (tests/parity/test_beam_search_parity.py checks it against transformers).
    The seeds' client with -b 3 prints the three."""
    import asyncio
    import subprocess
    import sys

    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.engine.beam_search import beam_search
    from mmserve.entrypoints.triton.outputs import full_text

    text = "USER: tell me a story ASSISTANT:"
    engine = AsyncEngine(offline.engine)
    try:

        async def run():
            inputs = await engine.preprocess({"prompt": text})
            return await beam_search(
                engine, inputs, SamplingParams(max_tokens=8), 3, 1.0, "offline-beams"
            )

        want = asyncio.run(run())
    finally:
        engine.shutdown()
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    arrays = {
        "text_input": np.array([[text.encode()]], dtype=np.object_),
        "max_tokens": np.array([[8]], dtype=np.int32),
        "beam_width": np.array([[3]], dtype=np.int32),
        "return_log_probs": np.array([[True]]),
    }
    inputs = [infer_input(name, arr, True) for name, arr in arrays.items()]
    result = client.infer("ensemble", inputs)
    texts = [t.decode() for t in result.as_numpy("text_output")]
    assert texts == [full_text(offline.tokenizer, want, False, k) for k in range(3)]
    cum = result.as_numpy("cum_log_probs")
    assert cum.shape == (1, 3) and cum[0].tolist() == pytest.approx(
        [c.cumulative_logprob for c in want.outputs]
    )
    per_token = result.as_numpy("output_log_probs")
    assert per_token.shape[:2] == (1, 3) and per_token[0].sum(-1).tolist() == pytest.approx(
        cum[0].tolist(), abs=1e-4
    )
    assert (
        cum[0, 0] / len(want.outputs[0].token_ids)
        >= cum[0, 2] / len(want.outputs[2].token_ids) - 1e-6
    )
    body = {
        "text_input": text,
        "max_tokens": 8,
        "beam_width": 3,
        "num_return_sequences": 2,
        "exclude_input_in_output": True,
    }
    r = httpx.post(f"{server.http_url}/v2/models/tensorrt_llm_bls/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["text_output"] == [c.text for c in want.outputs[:2]], (
        r.text
    )
    r = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate",
        timeout=60,
        json={**body, "beam_width": 4, "num_return_sequences": 5},
    )
    assert r.status_code == 400 and "num_return_sequences must be in [1, beam_width = 4]" in r.text
    # stop words end beams (each word as its own tokens, kept in the text); penalties count each beam's tokens
    word = offline.tokenizer.decode(want.outputs[0].token_ids[2:4])
    extra = {"stop_words": [word], "presence_penalty": 0.5, "frequency_penalty": 0.3}
    [stopped] = offline.beam_search(
        {"prompt": text},
        3,
        SamplingParams(max_tokens=8, stop=[word], presence_penalty=0.5, frequency_penalty=0.3),
    )
    r = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate", json={**body, **extra}, timeout=60
    )
    assert r.status_code == 200 and r.json()["text_output"] == [
        c.text for c in stopped.outputs[:2]
    ], r.text
    # guided decoding: every beam keeps to the guide (its mask comes before the log-probs the beams rank by)
    guided = {**body, "guided_decoding_guide_type": "regex", "guided_decoding_guide": "[a-z ]+"}
    r = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate", json=guided, timeout=60
    )
    assert r.status_code == 200 and len(r.json()["text_output"]) == 2, r.text
    assert all(re.fullmatch("[a-z ]+", t) for t in r.json()["text_output"]), r.text
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmserve.entrypoints.cli",
            "client",
            "--url",
            server.grpc_url,
            "--model_type",
            "llava",
            "--text",
            text,
            "--request-output-len",
            "8",
            "-b",
            "3",
            "--image",
            "",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert [f"[beam {k} ]:" in proc.stdout for k in range(3)] == [True] * 3


def test_streamed_beams_carry_every_beam_whole_then_the_final_ones(server, offline):
    """stream true with beam_width 2: each event holds the running beams so far, whole (they change from step to
    step, as TensorRT-LLM streams beams), best first; the last event holds what the same request answers without
    streaming. The token-level model streams output_ids rows the same way."""
    body = {
        "text_input": "USER: tell me a story ASSISTANT:",
        "max_tokens": 6,
        "beam_width": 2,
        "exclude_input_in_output": True,
    }
    final = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate", json=body, timeout=60
    ).json()
    with httpx.stream(
        "POST",
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate_stream",
        json={**body, "stream": True},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 3 and all("error" not in e for e in events)
    assert events[-1]["text_output"] == final["text_output"]
    assert len(events[0]["text_output"]) == 2
    ids = offline.tokenizer("USER: tell me a story ASSISTANT:").input_ids
    tokens = {
        "input_ids": ids,
        "input_lengths": len(ids),
        "request_output_len": 6,
        "beam_width": 2,
        "exclude_input_in_output": True,
    }
    done = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm/generate", json=tokens, timeout=60
    ).json()
    with httpx.stream(
        "POST",
        f"{server.http_url}/v2/models/tensorrt_llm/generate_stream",
        json={**tokens, "streaming": True},
        timeout=60,
    ) as r:
        streamed = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert len(streamed) >= 3 and streamed[-1]["output_ids"] == done["output_ids"]
    assert streamed[-1]["sequence_length"] == done["sequence_length"]
    # before the end, step k's event holds both running beams whole: k + 1 tokens each, not the newest one alone
    assert [e["sequence_length"] for e in streamed[:-1]] == [
        [k + 1, k + 1] for k in range(len(streamed) - 1)
    ]


def test_num_return_sequences_samples_that_many_sequences(server, offline):
    """num_return_sequences N without beams: N sampled sequences (sequence i seeded seed + i, as a one-sequence
    request with that seed), text_output [N] and cum_log_probs [1, N]. With stream true the N sequences stream side
    by side, each response one sequence's new text tagged with its sequence_index (TensorRT-LLM's), and the last
    response comes when all N have ended; the tensorrt_llm model streams their ids the same way."""
    text = "USER: tell me a story ASSISTANT:"
    body = {
        "text_input": text,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "num_return_sequences": 3,
        "exclude_input_in_output": True,
        "return_log_probs": True,
    }
    doc = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate", json=body, timeout=60
    ).json()
    singles = [
        offline.generate(
            {"prompt": text},
            SamplingParams(
                max_tokens=6, temperature=1.0, seed=5 + i, include_stop_str_in_output=True
            ),
            use_tqdm=False,
        )[0].outputs[0]
        for i in range(3)
    ]
    want = [c.text for c in singles]
    assert doc["text_output"] == want and len(set(want)) > 1
    assert len(doc["cum_log_probs"]) == 3 and all(v < 0 for v in doc["cum_log_probs"])
    with httpx.stream(
        "POST",
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate_stream",
        json={**body, "stream": True},
        timeout=60,
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and len(events) > 3
    pieces: dict[int, str] = {0: "", 1: "", 2: ""}
    for event in events:
        pieces[event["sequence_index"]] += event["text_output"]
    assert [pieces[i] for i in range(3)] == want
    ids = offline.tokenizer(text).input_ids
    tokens = {
        "input_ids": ids,
        "input_lengths": len(ids),
        "request_output_len": 6,
        "temperature": 1.0,
        "random_seed": 5,
        "num_return_sequences": 3,
        "streaming": True,
    }
    with httpx.stream(
        "POST", f"{server.http_url}/v2/models/tensorrt_llm/generate_stream", json=tokens, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for event in events:  # the generate extension writes a one-element tensor as a scalar
        new = event["output_ids"]
        streamed[event["sequence_index"]] += new if isinstance(new, list) else [new]
    assert [streamed[i] for i in range(3)] == [list(c.token_ids) for c in singles]
