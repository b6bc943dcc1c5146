"""A real server on a tiny Fuyu checkpoint: a Triton `ensemble` request with an image (the processor lays the
patch rows out itself: no placeholder in the text) and an OpenAI chat through the tokenizer's chat template
(Fuyu's processor has none), both answered as transformers answers them."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, FuyuForCausalLM

from mmserve.testing import image_to_data_uri, make_test_image
from mmserve.testing.fuyu import make_fuyu_checkpoint
from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def fuyu_dir(tmp_path_factory) -> str:
    return str(make_fuyu_checkpoint(tmp_path_factory.mktemp("tiny_fuyu_server"), preset="tiny", seed=0))


@pytest.fixture(scope="module")
def fuyu_server(fuyu_dir, tmp_path_factory):
    with start_server(fuyu_dir, tmp_path_factory.mktemp("fuyu-logs")) as handle:
        yield handle


def _hf_completion(model_dir: str, prompt: str, image: Image.Image, n: int) -> str:
    processor = AutoProcessor.from_pretrained(model_dir)
    model = FuyuForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    enc = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_ensemble_request_with_an_image(fuyu_server, fuyu_dir):
    image = make_test_image(3, (200, 100))
    body = {"text_input": "Generate a coco-style caption.\n", "max_tokens": 12, "temperature": 0,
            "image_url_input": image_to_data_uri(image), "exclude_input_in_output": True}
    r = httpx.post(f"{fuyu_server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == _hf_completion(fuyu_dir, body["text_input"], image, 12)


def test_openai_chat_with_a_picture_uses_the_tokenizer_template(fuyu_server, fuyu_dir):
    image = make_test_image(4)
    client = openai.OpenAI(base_url=f"{fuyu_server.http_url}/v1", api_key="none")
    content = [{"type": "image_url", "image_url": {"url": image_to_data_uri(image)}},
               {"type": "text", "text": "Describe this image."}]
    resp = client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": content}], max_tokens=12,
                                          temperature=0)
    # the tokenizer's template writes the message text and a newline; the processor adds the picture
    assert resp.choices[0].message.content == _hf_completion(fuyu_dir, "Describe this image.\n", image, 12)
