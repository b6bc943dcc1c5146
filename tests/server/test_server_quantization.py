"""`mmserve serve --quantization fp8`: a real server answers like the offline LLM with FP8 decoder weights,
and an unknown method stops the server at startup with the flag named."""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from tests.server.conftest import ensemble_texts, serve_with, start_server

PROMPTS = ["a cat on a mat", "two dogs in the park"]


@pytest.fixture(scope="module")
def fp8_weights_server(tiny_llava_dir, tmp_path_factory):
    with start_server(
        tiny_llava_dir, tmp_path_factory.mktemp("fp8-weights-logs"), "--quantization", "fp8"
    ) as handle:
        yield handle


def test_fp8_weights_server_matches_offline_fp8(fp8_weights_server, tiny_llava_dir):
    got = ensemble_texts(fp8_weights_server, PROMPTS, max_tokens=10)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompts = [f"USER:\n{t} ASSISTANT:" for t in PROMPTS]
    fp8, plain = (
        LLM(tiny_llava_dir, device="cpu", quantization=q).generate(prompts, params, use_tqdm=False)
        for q in ("fp8", None)
    )
    texts = [o.outputs[0].text for o in fp8]
    assert [t.endswith(w) for t, w in zip(got, texts)] == [True, True]
    assert texts != [
        o.outputs[0].text for o in plain
    ]  # the quantization changes what a random model says


def test_unknown_quantization_fails_at_startup(tiny_llava_dir):
    proc = serve_with(tiny_llava_dir, "--quantization", "awq")
    assert proc.returncode != 0 and "--quantization" in proc.stderr and "awq" in proc.stderr
