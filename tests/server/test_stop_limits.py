"""Bounded stop / bad-word lists (RequestLimits) against a real `mmserve serve`: more entries or characters than
allowed are a 400 / INVALID_ARGUMENT naming the list, what was sent and the limit with its flag, over OpenAI,
Triton HTTP (ensemble and the token-level tensorrt_llm model, beams included) and gRPC; a request at the limit is
served; `--max-stop-sequences` / `--max-stop-sequence-chars` set other limits."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from tests.server.conftest import start_server

MAX_ENTRIES, MAX_CHARS = 64, 4096  # the defaults


def _words(count: int, length: int = 8) -> list[str]:
    """`count` distinct strings of `length` characters the tiny model is not going to write."""
    return [f"~{i:03d}".ljust(length, "q") for i in range(count)]


def _openai(url: str, **body) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": "ensemble", "prompt": "Hello", "max_tokens": 3, "temperature": 0, **body},
        timeout=60,
    )


def _generate(url: str, **body) -> httpx.Response:
    return httpx.post(
        f"{url}/v2/models/ensemble/generate",
        json={"text_input": "Hello", "max_tokens": 3, "temperature": 0, **body},
        timeout=60,
    )


def _grpc_infer(url: str, model: str, arrays: dict[str, np.ndarray]):
    client = grpcclient.InferenceServerClient(url)
    tensors = []
    for name, arr in arrays.items():
        tensors.append(grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype)))
        tensors[-1].set_data_from_numpy(arr)
    return client.infer(model, tensors)


def _grpc_stop_words(url: str, words: list[str]):
    return _grpc_infer(
        url,
        "ensemble",
        {
            "text_input": np.array([[b"Hello"]], dtype=object),
            "max_tokens": np.array([[3]], np.int32),
            "stop_words": np.array([[w.encode() for w in words]], dtype=object),
        },
    )


def _word_list(words: list[list[int]]) -> np.ndarray:
    """TensorRT-LLM's [1, 2, L] word list layout."""
    flat = [t for w in words for t in w]
    ends = list(np.cumsum([len(w) for w in words]))
    return np.array([[flat, ends + [-1] * (len(flat) - len(ends))]], np.int32)


def _token_infer(url: str, **extra: np.ndarray):
    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    arrays = {
        "input_ids": np.array([[1, 65, 66]], np.int32),
        "input_lengths": np.array([[3]], np.int32),
        "request_output_len": np.array([[3]], np.int32),
        **extra,
    }
    inputs = []
    for name, arr in arrays.items():
        inputs.append(httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype)))
        inputs[-1].set_data_from_numpy(arr, binary_data=True)
    return client.infer("tensorrt_llm", inputs)


def test_openai_stop_lists_over_the_limit_are_400_naming_it(server):
    url = server.http_url
    cases = [
        (
            dict(stop=_words(MAX_ENTRIES + 1)),
            "stop",
            "stop: 65 entries, more than --max-stop-sequences=64",
        ),
        (
            dict(stop=_words(MAX_ENTRIES, 65)),
            "stop",
            "stop: 4160 characters in all, more than --max-stop-sequence-chars=4096",
        ),
        (
            dict(stop_token_ids=list(range(1000, 1065))),
            "stop_token_ids",
            "stop_token_ids: 65 entries, more than --max-stop-sequences=64",
        ),
        (dict(stop=_words(MAX_ENTRIES + 1), n=2), "stop", "--max-stop-sequences=64"),
        (
            dict(stop=_words(MAX_ENTRIES + 1), n=2, use_beam_search=True),
            "stop",
            "--max-stop-sequences=64",
        ),
    ]
    for body, param, message in cases:
        r = _openai(url, **body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param, error
    for body in (
        dict(stop=_words(MAX_ENTRIES, MAX_CHARS // MAX_ENTRIES)),
        dict(stop_token_ids=list(range(1000, 1064))),
        dict(stop=_words(MAX_ENTRIES), n=2, use_beam_search=True),
    ):  # at the limits
        r = _openai(url, **body)
        assert r.status_code == 200, r.text


def test_triton_http_stop_and_bad_words_over_the_limit_are_400_naming_them(server):
    url = server.http_url
    for field in ("stop_words", "bad_words"):
        r = _generate(url, **{field: _words(MAX_ENTRIES + 1)})
        assert (
            r.status_code == 400
            and r.json()["error"] == f"{field}: 65 entries, more than --max-stop-sequences=64"
        ), r.text
        r = _generate(url, **{field: _words(MAX_ENTRIES, 65)})
        assert (
            r.status_code == 400
            and r.json()["error"]
            == f"{field}: 4160 characters in all, more than --max-stop-sequence-chars=4096"
        ), r.text
        r = _generate(url, **{field: _words(MAX_ENTRIES, MAX_CHARS // MAX_ENTRIES)})
        assert r.status_code == 200, r.text
    r = _generate(
        url, stop_words=_words(MAX_ENTRIES + 1), beam_width=2
    )  # beam search checks them too
    assert r.status_code == 400 and "stop_words: 65 entries" in r.json()["error"], r.text
    assert _generate(url, stop_words=_words(MAX_ENTRIES), beam_width=2).status_code == 200


def test_token_model_word_lists_over_the_limit_are_400_naming_them(server):
    url = server.http_url
    for field in ("stop_words_list", "bad_words_list"):
        with pytest.raises(InferenceServerException) as err:
            _token_infer(url, **{field: _word_list([[100 + i] for i in range(MAX_ENTRIES + 1)])})
        assert f"{field}: 65 entries, more than --max-stop-sequences=64" in err.value.message()
        assert err.value.status() == "400"
        with pytest.raises(InferenceServerException) as err:
            _token_infer(url, **{field: _word_list([[100] * 65] * MAX_ENTRIES)})
        assert (
            f"{field}: 4160 token ids in all, more than --max-stop-sequence-chars=4096"
            in err.value.message()
        )
        _token_infer(url, **{field: _word_list([[100] * 64] * MAX_ENTRIES)})


def test_grpc_stop_words_over_the_limit_are_invalid_argument(server):
    with pytest.raises(InferenceServerException) as err:
        _grpc_stop_words(server.grpc_url, _words(MAX_ENTRIES + 1))
    assert "INVALID_ARGUMENT" in err.value.status()
    assert "stop_words: 65 entries, more than --max-stop-sequences=64" in err.value.message()
    result = _grpc_stop_words(server.grpc_url, _words(MAX_ENTRIES))
    assert result.as_numpy("text_output") is not None


def test_flags_set_other_limits(tiny_llava_dir, tmp_path):
    with start_server(
        tiny_llava_dir, tmp_path, "--max-stop-sequences", "2", "--max-stop-sequence-chars", "10"
    ) as srv:
        r = _openai(srv.http_url, stop=_words(3, 2))
        assert (
            r.status_code == 400
            and "stop: 3 entries, more than --max-stop-sequences=2" in r.json()["error"]["message"]
        )
        r = _generate(srv.http_url, bad_words=["abcdef", "ghijk"])
        assert (
            r.status_code == 400
            and r.json()["error"]
            == "bad_words: 11 characters in all, more than --max-stop-sequence-chars=10"
        )
        with pytest.raises(InferenceServerException) as err:
            _grpc_stop_words(srv.grpc_url, _words(3, 2))
        assert (
            "INVALID_ARGUMENT" in err.value.status()
            and "--max-stop-sequences=2" in err.value.message()
        )
        assert _openai(srv.http_url, stop=_words(2, 5)).status_code == 200
        assert _generate(srv.http_url, stop_words=_words(2, 5)).status_code == 200
