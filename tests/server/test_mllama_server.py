"""A real server on a tiny Llama 3.2 Vision (Mllama) checkpoint: the seeds' documented Triton request for it
(`<|image|>` in `text_input`, an image URL as a data URI) and an OpenAI chat with a picture, both answered as
transformers answers them."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, MllamaForConditionalGeneration

from mmserve.testing import image_to_data_uri, make_test_image
from mmserve.testing.mllama import make_mllama_checkpoint
from tests.server.conftest import start_server

HAIKU = "<|image|>If I had to write a haiku for this one"


@pytest.fixture(scope="module")
def mllama_dir(tmp_path_factory) -> str:
    return str(
        make_mllama_checkpoint(tmp_path_factory.mktemp("tiny_mllama_server"), preset="tiny", seed=0)
    )


@pytest.fixture(scope="module")
def mllama_server(mllama_dir, tmp_path_factory):
    with start_server(mllama_dir, tmp_path_factory.mktemp("mllama-logs")) as handle:
        yield handle


def _hf_completion(
    model_dir: str,
    prompt: str,
    image: Image.Image | list,
    n: int,
    eos: int | list[int] | None = None,
    chat: list | None = None,
) -> str:
    processor = AutoProcessor.from_pretrained(model_dir)
    model = MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    if chat is not None:
        prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    enc = processor(
        text=prompt, images=image if isinstance(image, list) else [image], return_tensors="pt"
    )
    kw = {} if eos is None else {"eos_token_id": eos}
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, **kw)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def test_seed_mllama_request_on_the_ensemble(mllama_server, mllama_dir):
    source = image_to_data_uri(make_test_image(7), "jpeg")
    image = Image.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1]))).convert("RGB")
    tok = AutoProcessor.from_pretrained(mllama_dir).tokenizer
    end_id, pad_id = tok.convert_tokens_to_ids(["<|end_of_text|>", "<|finetune_right_pad_id|>"])
    body = {
        "id": "42",
        "text_input": HAIKU,
        "image_url_input": source,
        "parameters": {
            "max_tokens": 16,
            "beam_width": 1,
            "end_id": end_id,
            "pad_id": pad_id,
            "top_k": 1,
            "top_p": 0,
            "stream": False,
            "temperature": 0,
        },
    }
    r = httpx.post(f"{mllama_server.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    want = _hf_completion(mllama_dir, HAIKU, image, 16, eos=end_id)
    assert want and out["text_output"].endswith(want)
    # the prompt comes back first, as the model saw it but without the image token
    assert (
        out["text_output"].startswith("If I had to write a haiku for this one")
        and "<|image|>" not in out["text_output"]
    )
    body["parameters"]["exclude_input_in_output"] = True
    assert (
        httpx.post(
            f"{mllama_server.http_url}/v2/models/ensemble/generate", json=body, timeout=120
        ).json()["text_output"]
        == want
    )


def test_openai_chat_with_a_picture(mllama_server, mllama_dir):
    image = make_test_image(9, (96, 40))  # two of the four tiles are padding
    client = openai.OpenAI(base_url=f"{mllama_server.http_url}/v1", api_key="none")
    content = [
        {"type": "image_url", "image_url": {"url": image_to_data_uri(image)}},
        {"type": "text", "text": "What is in this picture?"},
    ]
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0
    )
    chat = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}],
        }
    ]
    want = _hf_completion(mllama_dir, "", image, 12, chat=chat)
    assert resp.choices[0].message.content == want
    # a picture with no <|image|> in the text the client wrote: the ensemble puts it first
    r = httpx.post(
        f"{mllama_server.http_url}/v2/models/ensemble/generate",
        json={
            "text_input": "What is in this picture?",
            "max_tokens": 12,
            "temperature": 0,
            "image_url_input": image_to_data_uri(image),
            "exclude_input_in_output": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == _hf_completion(
        mllama_dir, "<|image|>What is in this picture?", image, 12
    )
    # two pictures: both placeholders go first (adjacent, so the text attends both)
    second = make_test_image(10)
    r = httpx.post(
        f"{mllama_server.http_url}/v2/models/ensemble/generate",
        json={
            "text_input": "Compare them.",
            "max_tokens": 12,
            "temperature": 0,
            "image_url_input": [image_to_data_uri(image), image_to_data_uri(second)],
            "exclude_input_in_output": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == _hf_completion(
        mllama_dir, "<|image|><|image|>Compare them.", [image, second], 12
    )


def test_metrics_show_the_cross_attention_pool(mllama_server):
    """After the requests above have ended the pool has blocks and none is held (they went back on finish)."""
    text = httpx.get(f"{mllama_server.http_url}/metrics", timeout=30).text

    def value(name: str) -> float:
        return float(
            next(
                ln.split()[-1]
                for ln in text.splitlines()
                if ln.startswith((name + " ", name + "{"))
            )
        )

    assert value("mmserve_cross_kv_cache_blocks_total") > 0
    assert value("mmserve_cross_kv_cache_usage_ratio") == 0
