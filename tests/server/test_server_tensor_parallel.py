"""`mmserve serve --tensor-parallel-size 2`: a real server whose language model is sharded over two processes
answers Triton requests (text, and an image over gRPC with tritonclient) as the one-process offline LLM does."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from mmserve import LLM, SamplingParams
from mmserve.testing import make_test_image
from tests.server.conftest import ensemble_texts, start_server
from tests.server.test_triton_grpc import TEXT, completion, seed_inputs

PROMPTS = ["a cat on a mat", "two dogs in the park"]


@pytest.fixture(scope="module")
def tp_server(tiny_llava_dir, tmp_path_factory):
    with start_server(tiny_llava_dir, tmp_path_factory.mktemp("tp-logs"), "--tensor-parallel-size", "2") as handle:
        yield handle


def test_sharded_server_answers_as_one_process(tp_server, tiny_llava_dir):
    got = ensemble_texts(tp_server, PROMPTS, max_tokens=10)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    offline = LLM(tiny_llava_dir, device="cpu").generate([f"USER:\n{t} ASSISTANT:" for t in PROMPTS], params,
                                                       use_tqdm=False)
    assert [g.endswith(o.outputs[0].text) for g, o in zip(got, offline)] == [True, True]


def test_sharded_server_answers_an_image_over_grpc(tp_server, tiny_llava_dir):
    image = np.asarray(make_test_image(6, size=(30, 20)))[None, None]      # [1, 1, H, W, 3] uint8
    _, want = completion(LLM(tiny_llava_dir, device="cpu"), {"prompt": f"USER:\n<image>{TEXT} ASSISTANT:",
                                                             "images": [make_test_image(6, (30, 20))]},
                         max_tokens=16, top_k=1)
    with grpcclient.InferenceServerClient(tp_server.grpc_url) as client:
        for model in ("ensemble", "tensorrt_llm_bls"):
            assert client.infer(model, seed_inputs("image_bytes_input", image)).as_numpy("text_output")[0] \
                .decode() == want
