"""The routing key of the Ray Serve ingress (serving_ray/routing_key.py) and the replicas' metrics combined
(serving_ray/metrics_sum.py), on the request shapes of the Triton, KServe and OpenAI APIs."""

from __future__ import annotations

import json

from mmserve.serving_ray.metrics_sum import per_replica, summed
from mmserve.serving_ray.routing_key import routing_key

PIC = "data:image/png;base64,iVBORw0KGgo="


def key(doc) -> str | None:
    return routing_key(json.dumps(doc).encode())


def test_same_picture_same_key_across_questions_and_apis():
    triton = key({"text_input": "USER: <image>\nWhat? ASSISTANT:", "image_url_input": PIC})
    other_question = key({"text_input": "USER: <image>\nWho? ASSISTANT:", "image_url_input": PIC})
    chat = key(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Describe"},
                        {"type": "image_url", "image_url": {"url": PIC}},
                    ],
                }
            ],
        }
    )
    assert triton == other_question == chat and triton.startswith("media:")
    assert key({"text_input": "x", "image_url_input": PIC + "A"}) != triton


def test_text_requests_keyed_by_prompt_prefix():
    long = "S" * 300
    assert key({"prompt": long + "one"}) == key({"prompt": long + "two"})
    assert key({"prompt": "one"}) != key({"prompt": "two"})
    kserve = {"inputs": [{"name": "text_input", "datatype": "BYTES", "data": ["hello"]}]}
    assert key(kserve) == key({"text_input": "hello"}) and key(kserve).startswith("prefix:")


def test_no_key_without_prompt_or_media_or_json():
    assert key({"max_tokens": 4}) is None
    assert routing_key(b"not json") is None


def test_metrics_summed_and_per_replica():
    def text(tokens: float, usage: float) -> str:
        return (
            "# HELP t_total Tokens\n# TYPE t_total counter\n"
            f't_total{{model_name="m"}} {tokens}\n'
            "# HELP u_ratio Usage\n# TYPE u_ratio gauge\n"
            f'u_ratio{{model_name="m"}} {usage}\n'
        )

    out = summed([text(3.0, 0.2), text(5.0, 0.4)])
    assert (
        't_total{model_name="m"} 8.0' in out
        and 'u_ratio{model_name="m"} 0.30000000000000004' in out
    )
    rows = per_replica({"a": text(3.0, 0.2), "b": text(5.0, 0.4)})
    assert 't_total{model_name="m",replica="a"} 3.0' in rows
    assert 't_total{model_name="m",replica="b"} 5.0' in rows
    assert rows.count("# TYPE t_total counter") == 1
