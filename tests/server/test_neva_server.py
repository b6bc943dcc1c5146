"""A real server on a tiny NeVA served straight from its `.nemo` (no config.json, no NeMo): the Triton `ensemble`
wraps the text in the seeds' NeVA template, an OpenAI chat follows the same template, and bad input is a 4xx while
the server keeps serving; a directory without a checkpoint still fails at start with one line."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.triton.prompts import build_prompt
from mmserve.testing import image_to_data_uri, make_test_image
from mmserve.testing.neva import chat_prompt, make_neva_checkpoint
from tests.server.conftest import start_server

N = 8
PICTURE = make_test_image(51, (44, 40))


@pytest.fixture(scope="module")
def neva(tmp_path_factory):
    model_dir = str(
        make_neva_checkpoint(tmp_path_factory.mktemp("neva_server"), preset="tiny-swiglu")
    )
    with start_server(model_dir, tmp_path_factory.mktemp("neva-logs")) as handle:
        yield handle, LLM(model_dir, device="cpu")


def test_ensemble_and_chat_use_the_seeds_template(neva):
    server, offline = neva
    params = SamplingParams(max_tokens=N, temperature=0.0)
    assert build_prompt("neva", "What is it?", 1) == chat_prompt("What is it?")
    body = {
        "text_input": "What is it?",
        "max_tokens": N,
        "temperature": 0,
        "image_url_input": image_to_data_uri(PICTURE),
        "exclude_input_in_output": True,
    }
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    expected = offline.generate(
        {"prompt": chat_prompt("What is it?"), "images": [PICTURE]}, params, use_tqdm=False
    )[0]
    assert r.json()["text_output"] == expected.outputs[0].text

    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="x")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_to_data_uri(PICTURE)}},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    got = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=N, temperature=0
    )
    assert got.choices[0].message.content == expected.outputs[0].text


def test_bad_input_is_a_4xx(neva):
    server, _ = neva
    body = {"text_input": "<image>\n<image>\nboth?", "max_tokens": 4}
    body["image_url_input"] = image_to_data_uri(PICTURE)
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
    assert r.status_code == 400 and "placeholder" in r.text, r.text
    ok = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate",
        json={"text_input": "hi", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_a_directory_without_a_checkpoint_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("no model here")
    proc = subprocess.run(
        [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no config.json" in proc.stderr
    assert "Traceback" not in proc.stderr
