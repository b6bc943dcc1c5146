"""`mmserve serve --quantization fp8`: a real server answers like the offline LLM with FP8 decoder weights,
and an unknown method stops the server at startup with the flag named."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from mmserve import LLM, SamplingParams
from tests.server.conftest import start_server

PROMPTS = ["a cat on a mat", "two dogs in the park"]


@pytest.fixture(scope="module")
def fp8_weights_server(tiny_llava_dir, tmp_path_factory):
    with start_server(tiny_llava_dir, tmp_path_factory.mktemp("fp8-weights-logs"), "--quantization", "fp8") as handle:
        yield handle


def test_fp8_weights_server_matches_offline_fp8(fp8_weights_server, tiny_llava_dir):
    r = httpx.post(f"{fp8_weights_server.http_url}/v2/models/ensemble/generate",
                   json={"text_input": PROMPTS, "max_tokens": [10, 10], "temperature": [0, 0]}, timeout=60)
    assert r.status_code == 200, r.text
    params = SamplingParams(max_tokens=10, temperature=0.0)
    prompts = [f"USER:\n{t} ASSISTANT:" for t in PROMPTS]
    fp8, plain = (LLM(tiny_llava_dir, device="cpu", quantization=q).generate(prompts, params, use_tqdm=False)
                  for q in ("fp8", None))
    texts = [o.outputs[0].text for o in fp8]
    assert [t.endswith(w) for t, w in zip(r.json()["text_output"], texts)] == [True, True]
    assert texts != [o.outputs[0].text for o in plain]   # the quantization changes what a random model says


def test_unknown_quantization_fails_at_startup(tiny_llava_dir):
    proc = subprocess.run([sys.executable, "-m", "mmserve.entrypoints.cli", "serve", tiny_llava_dir,
                           "--device", "cpu", "--quantization", "awq"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--quantization" in proc.stderr and "awq" in proc.stderr
