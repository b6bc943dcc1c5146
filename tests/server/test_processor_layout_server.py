"""Real servers on tiny checkpoints of the families whose processor lays the picture out itself (no placeholder in
the text: Fuyu's patch rows, Kosmos-2's image span): a Triton `ensemble` request with an image and an OpenAI
chat through the tokenizer's chat template (their processors have none), both answered as transformers answers
them."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from PIL import Image

from mmserve.testing import image_to_data_uri, make_checkpoint, make_test_image
from tests.parity.hf_oracle import _load
from tests.server.conftest import start_server

# family -> (the text the ensemble gets, the picture's size)
CASES = {
    "fuyu": ("Generate a coco-style caption.\n", (200, 100)),
    "kosmos2": ("<grounding>An image of", (48, 40)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def family_server(request, tmp_path_factory):
    family = request.param
    model_dir = str(
        make_checkpoint(family, tmp_path_factory.mktemp(f"tiny_{family}_server"), preset="tiny")
    )
    with start_server(model_dir, tmp_path_factory.mktemp(f"{family}-logs")) as handle:
        yield family, model_dir, handle


def _hf_completion(model_dir: str, prompt: str, image: Image.Image, n: int) -> str:
    model, processor = _load(model_dir, "cpu")
    enc = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_ensemble_request_with_an_image(family_server):
    family, model_dir, server = family_server
    text, size = CASES[family]
    image = make_test_image(3, size)
    body = {
        "text_input": text,
        "max_tokens": 12,
        "temperature": 0,
        "image_url_input": image_to_data_uri(image),
        "exclude_input_in_output": True,
    }
    r = httpx.post(f"{server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == _hf_completion(model_dir, text, image, 12)


def test_openai_chat_with_a_picture_uses_the_tokenizer_template(family_server):
    _, model_dir, server = family_server
    image = make_test_image(4)
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
    content = [
        {"type": "image_url", "image_url": {"url": image_to_data_uri(image)}},
        {"type": "text", "text": "Describe this image."},
    ]
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        max_tokens=12,
        temperature=0,
    )
    # the tokenizer's template writes the message text and a newline; the processor adds the picture
    assert resp.choices[0].message.content == _hf_completion(
        model_dir, "Describe this image.\n", image, 12
    )
