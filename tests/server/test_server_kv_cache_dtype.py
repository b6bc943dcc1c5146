"""`mmserve serve --kv-cache-dtype fp8`: a real server answers like the offline LLM with an FP8 KV cache,
and an unknown KV cache dtype stops the server at startup with the flag named."""

from __future__ import annotations

import re

import httpx
import pytest

from mmserve import LLM, SamplingParams
from tests.server.conftest import ensemble_texts, serve_with, start_server

PROMPTS = ["a cat on a mat", "two dogs in the park"]


@pytest.fixture(scope="module")
def fp8_server(tiny_llava_dir, tmp_path_factory):
    with start_server(
        tiny_llava_dir, tmp_path_factory.mktemp("fp8-logs"), "--kv-cache-dtype", "fp8"
    ) as handle:
        yield handle


def test_fp8_kv_cache_server_matches_offline_fp8_and_reports_it(fp8_server, tiny_llava_dir):
    got = ensemble_texts(fp8_server, PROMPTS, max_tokens=10)
    offline = LLM(tiny_llava_dir, device="cpu", kv_cache_dtype="fp8")
    outs = offline.generate(
        [f"USER:\n{t} ASSISTANT:" for t in PROMPTS],
        SamplingParams(max_tokens=10, temperature=0.0),
        use_tqdm=False,
    )
    wants = [
        offline.tokenizer.decode(o.prompt_token_ids, skip_special_tokens=True) + o.outputs[0].text
        for o in outs
    ]
    assert got == wants
    metrics = httpx.get(f"{fp8_server.http_url}/metrics", timeout=30).text
    per_token = offline.engine.runner.kv_bytes_per_block() / offline.engine.config.cache.block_size
    layers = len(offline.engine.runner.attn_layers)
    attn = offline.engine.runner.attn_layers[0]
    assert per_token == 2 * layers * attn.num_kv_heads * attn.head_dim  # one byte per element
    assert re.search(rf"^mmserve_kv_cache_bytes_per_token{{[^}}]*}} {per_token}$", metrics, re.M)
    blocks = float(offline.engine.kv.num_blocks)
    assert re.search(rf"^mmserve_kv_cache_blocks_total{{[^}}]*}} {blocks}$", metrics, re.M)


def test_unknown_kv_cache_dtype_fails_at_startup(tiny_llava_dir):
    proc = serve_with(tiny_llava_dir, "--kv-cache-dtype", "int4")
    assert proc.returncode != 0 and "--kv-cache-dtype" in proc.stderr and "int4" in proc.stderr
