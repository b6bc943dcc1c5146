"""A real server on a tiny CogVLM2 checkpoint: the Triton `ensemble` (the text as sent, the picture right after BOS)
and an OpenAI chat (the original "chat" template: "Question: … Answer:") answer as the offline API does, and two
pictures get a 400 naming the limit while the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from mmserve import LLM, SamplingParams
from mmserve.testing import image_to_data_uri, make_test_image
from mmserve.testing.cogvlm import make_cogvlm2_checkpoint
from tests.server.conftest import start_server

N = 8
PICTURE = make_test_image(31, (50, 40))


@pytest.fixture(scope="module")
def cogvlm(tmp_path_factory):
    model_dir = str(make_cogvlm2_checkpoint(tmp_path_factory.mktemp("cogvlm_server")))
    with start_server(model_dir, tmp_path_factory.mktemp("cogvlm-logs")) as handle:
        yield handle, LLM(model_dir, device="cpu")


def test_ensemble_and_openai_chat_answer_as_offline(cogvlm):
    server, offline = cogvlm
    params = SamplingParams(max_tokens=N, temperature=0.0)
    text = "Question: what is shown? Answer:"
    body = {
        "text_input": text,
        "max_tokens": N,
        "temperature": 0,
        "image_url_input": image_to_data_uri(PICTURE),
        "exclude_input_in_output": True,
    }
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    expected = offline.generate({"prompt": text, "images": [PICTURE]}, params, use_tqdm=False)
    assert r.json()["text_output"] == expected[0].outputs[0].text

    client = OpenAI(base_url=f"{server.http_url}/v1", api_key="x")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_to_data_uri(PICTURE)}},
                {"type": "text", "text": "what is shown?"},
            ],
        }
    ]
    got = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, max_tokens=N, temperature=0
    )
    chat = offline.chat(messages, params, use_tqdm=False)[0]
    assert chat.prompt == text  # the original template around the question
    assert got.choices[0].message.content == chat.outputs[0].text


def test_two_pictures_are_a_400_and_the_server_keeps_serving(cogvlm):
    server, _ = cogvlm
    body = {
        "text_input": "Question: compare? Answer:",
        "max_tokens": 4,
        "image_url_input": [image_to_data_uri(PICTURE), image_to_data_uri(make_test_image(32))],
    }
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=60)
    assert r.status_code == 400 and "at most one image" in r.text, r.text
    ok = httpx.post(
        f"{server.http_url}/v2/models/ensemble/generate",
        json={"text_input": "Question: hi? Answer:", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
