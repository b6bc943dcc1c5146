"""One config surface on a real `mmserve serve`: settings from a --config YAML file, MMSERVE_* variables and the
command line, the command line winning over the environment over the file; the Triton model config's
max_batch_size is --max-num-seqs; the server-wide exclude_input_in_output and skip_special_tokens defaults apply
to Triton requests that do not send them; a bad variable stops serve with one line and status 2."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def configured(tiny_llava_dir, tmp_path_factory):
    """A server whose settings come from three places: the file sets max-num-seqs 9, served_model_name,
    exclude-input-in-output and skip_special_tokens; the environment max-num-seqs 5 and the served name; the
    command line max-num-seqs 3."""
    tmp = tmp_path_factory.mktemp("configured")
    config = tmp / "serve.yaml"
    config.write_text(
        "max-num-seqs: 9\nserved_model_name: from-file\nexclude-input-in-output: true\n"
        "skip_special_tokens: false\n"
    )
    env = {"MMSERVE_MAX_NUM_SEQS": "5", "MMSERVE_SERVED_MODEL_NAME": "from-env"}
    with contextlib.ExitStack() as stack:
        with _environ(env):  # only this server's: start_server passes its environment on
            handle = stack.enter_context(
                start_server(tiny_llava_dir, tmp, "--config", str(config), "--max-num-seqs", "3")
            )
        yield handle


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def test_settings_come_from_the_command_line_then_environment_then_file(configured):
    models = httpx.get(f"{configured.http_url}/v1/models", timeout=10).json()
    assert "from-env" in [m["id"] for m in models["data"]]  # the environment over the file
    http = httpclient.InferenceServerClient(f"127.0.0.1:{configured.http_port}")
    assert http.get_model_config("ensemble")["max_batch_size"] == 3  # the command line over both
    grpc = grpcclient.InferenceServerClient(configured.grpc_url)
    assert grpc.get_model_config("tensorrt_llm").config.max_batch_size == 3


def _generate(server, **inputs) -> str:
    body = {"text_input": "hello", "max_tokens": 3, "temperature": 0, **inputs}
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["text_output"]


def test_the_server_wide_triton_defaults_apply_when_a_request_sends_none(configured):
    alone = _generate(configured)
    with_prompt = _generate(configured, exclude_input_in_output=False)
    assert with_prompt.startswith("USER:") and with_prompt.endswith(alone) and alone != with_prompt
    assert _generate(configured, exclude_input_in_output=True) == alone
    # --no-skip-special-tokens (skip_special_tokens: false): a special token the bias forces stays in the text
    forced = _generate(configured, embedding_bias_words=["<image>"], embedding_bias_weights=[100.0])
    assert forced == "<image>" * 3


def test_skip_special_tokens_is_on_by_default(server):
    r = httpx.post(
        f"{server.http_url}/v2/models/tensorrt_llm_bls/generate",
        json={
            "text_input": "hello",
            "max_tokens": 3,
            "temperature": 0,
            "embedding_bias_words": ["<image>"],
            "embedding_bias_weights": [100.0],
            "exclude_input_in_output": True,
        },
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["text_output"] == "", r.text
    inputs = [grpcclient.InferInput("text_input", [1, 1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([[b"hello"]], dtype=object))
    inputs.append(grpcclient.InferInput("max_tokens", [1, 1], "INT32"))
    inputs[1].set_data_from_numpy(np.array([[2]], dtype=np.int32))
    text = grpcclient.InferenceServerClient(server.grpc_url).infer("ensemble", inputs)
    assert text.as_numpy("text_output")[0].decode().startswith("USER:")  # the prompt by default


def test_a_bad_environment_value_stops_serve_with_one_line(tiny_llava_dir):
    run = subprocess.run(
        [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", tiny_llava_dir],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "MMSERVE_MAX_NUM_SEQS": "x"},
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines() == [
        "mmserve serve: MMSERVE_MAX_NUM_SEQS: invalid int value 'x'"
    ]
