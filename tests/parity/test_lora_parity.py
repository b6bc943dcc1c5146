"""LoRA adapters served beside the base model, against transformers with the adapter merged into its weights.

Covers: one adapter's greedy ids and log-probs; a staggered batch mixing two adapters and the base model (each row
gets only its own delta); prefix-cache keys that separate adapters (and exact repeats that still hit); rsLoRA
scaling; bad adapters and unknown names refused with the field named; and the OpenAI `model` naming an adapter.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from mmserve import LLM, SamplingParams
from mmserve.testing import image_to_data_uri, make_test_image
from mmserve.testing.lora import make_lora_adapter, merge_lora_into
from tests.parity.hf_oracle import TOL, assert_matches_oracle, run_staggered
from tests.server.conftest import start_server

N = 16
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


@functools.lru_cache(maxsize=4)
def _hf(model_dir: str, adapter_dir: str | None):
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    if adapter_dir is not None:
        merge_lora_into(model, adapter_dir)
    return model, transformers.AutoProcessor.from_pretrained(model_dir)


def _oracle(model_dir: str, adapter_dir: str | None, prompt: dict, device: str = "cpu"):
    """The merged model on the CPU; pictures resized where mmserve resizes them (on the GPU when it runs there)."""
    model, processor = _hf(model_dir, adapter_dir)
    kw = {"device": device} if device != "cpu" else {}
    enc = processor(
        text=prompt["prompt"], images=prompt.get("images") or None, return_tensors="pt", **kw
    ).to("cpu")
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    n = enc["input_ids"].shape[1]
    return (
        enc["input_ids"][0].tolist(),
        out.sequences[0, n:].tolist(),
        torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1),
    )


def _prompt(i: int, lora: str | None) -> dict:
    p = {
        "prompt": PROMPT if i % 2 == 0 else f"USER: say {i} words ASSISTANT:",
        "images": [make_test_image(i)] if i % 2 == 0 else [],
    }
    return {**p, "lora": lora} if lora else p


def test_adapter_request_matches_transformers_with_the_adapter_merged(
    tiny_llava_dir, lora_adapters
):
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", lora_modules=lora_adapters)
    prompt = _prompt(0, "alpha")
    out = llm.generate([prompt], GREEDY)[0]
    assert_matches_oracle(out, _oracle(tiny_llava_dir, lora_adapters["alpha"], prompt))
    base = llm.generate([_prompt(0, None)], GREEDY)[0]
    assert base.outputs[0].token_ids != out.outputs[0].token_ids  # the adapter changes the answer


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_mixes_two_adapters_and_the_base_model(
    tiny_llava_dir, lora_adapters, device
):
    llm = LLM(
        tiny_llava_dir,
        device=device,
        dtype="float32",
        lora_modules=lora_adapters,
        enable_prefix_caching=False,
    )
    names = ["alpha", None, "beta", "alpha", None, "beta"]
    prompts = [_prompt(i, name) for i, name in enumerate(names)]
    for prompt, name, out in zip(prompts, names, run_staggered(llm.engine, prompts, GREEDY)):
        assert_matches_oracle(
            out, _oracle(tiny_llava_dir, lora_adapters.get(name), prompt, device), TOL[device]
        )
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_prefix_cache_keeps_adapters_apart(tiny_llava_dir, lora_adapters):
    llm = LLM(
        tiny_llava_dir, device="cpu", dtype="float32", lora_modules=lora_adapters, block_size=4
    )
    base = llm.generate([_prompt(0, None)], GREEDY)[0]
    assert base.metrics.num_cached_tokens == 0
    first = llm.generate([_prompt(0, "alpha")], GREEDY)[
        0
    ]  # same text and picture, other weights: no hit
    assert first.metrics.num_cached_tokens == 0
    again = llm.generate([_prompt(0, "alpha")], GREEDY)[0]  # the same adapter again: hits
    assert again.metrics.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_matches_oracle(
        again, _oracle(tiny_llava_dir, lora_adapters["alpha"], _prompt(0, "alpha"))
    )


def test_bad_adapters_and_names_are_refused(tiny_llava_dir, lora_adapters, tmp_path):
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", lora_modules=lora_adapters)
    with pytest.raises(ValueError, match="lora: unknown LoRA adapter 'gamma'"):
        llm.generate([_prompt(1, "gamma")], GREEDY)
    with pytest.raises(ValueError, match="lora: must be an adapter name"):
        llm.generate([{"prompt": "hi", "lora": 3}], GREEDY)
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running
    vision = make_lora_adapter(tmp_path / "vision", tiny_llava_dir, targets=("q_proj",))
    tensors_cfg = json.loads((vision / "adapter_config.json").read_text())
    # an adapter on the vision tower's q_proj (PEFT's target_modules match it too) is refused by name
    from safetensors.torch import load_file, save_file

    t = load_file(str(vision / "adapter_model.safetensors"))
    t[
        "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"
    ] = torch.zeros(tensors_cfg["r"], 32)
    t[
        "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_B.weight"
    ] = torch.zeros(32, tensors_cfg["r"])
    save_file(t, str(vision / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="outside the language model"):
        llm.engine.add_lora("vision", str(vision))
    wrong = make_lora_adapter(tmp_path / "wrong", tiny_llava_dir, rank=4)
    cfg = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**cfg, "r": 5}))
    with pytest.raises(ValueError, match="needs \\[5,"):
        llm.engine.add_lora("wrong", str(wrong))
    assert sorted(llm.engine.lora.adapters) == ["alpha", "beta"]


def test_openai_model_and_triton_lora_task_id_name_an_adapter(
    tiny_llava_dir, lora_adapters, tmp_path
):
    # the seeds' Triton LoRA flow sends lora_task_id alone once the adapter is loaded: here it loads at startup
    flags = [
        "--lora-modules",
        *(f"{k}={v}" for k, v in lora_adapters.items()),
        f"7={lora_adapters['alpha']}",
    ]
    text = "USER: tell me a story ASSISTANT:"
    with start_server(tiny_llava_dir, tmp_path, *flags) as server:
        client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none")
        cards = {m.id: m for m in client.models.list().data}
        assert {"alpha", "beta", "7"} <= set(cards) and cards["alpha"].parent == Path(
            tiny_llava_dir
        ).name
        assert getattr(cards["ensemble"], "parent", None) is None
        got = {
            name: client.completions.create(model=name, prompt=text, max_tokens=8, temperature=0)
            .choices[0]
            .text
            for name in ("alpha", "beta")
        }
        bls = f"{server.http_url}/v2/models/tensorrt_llm_bls/generate"
        body = {
            "text_input": text,
            "max_tokens": 8,
            "temperature": 0,
            "exclude_input_in_output": True,
        }
        r = httpx.post(bls, json={**body, "lora_task_id": 7}, timeout=60)
        assert r.status_code == 200, r.text
        task7 = r.json()["text_output"]
        missing = httpx.post(bls, json={**body, "lora_task_id": 9}, timeout=60)
        assert (
            missing.status_code == 400 and "lora_task_id: LoRA task 9 is not loaded" in missing.text
        )
        infer = {
            "inputs": [
                {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [text]},
                {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [8]},
                {"name": "lora_config", "datatype": "INT32", "shape": [1, 1, 3], "data": [0, 0, 4]},
            ]
        }
        weights = httpx.post(
            f"{server.http_url}/v2/models/tensorrt_llm_bls/infer", json=infer, timeout=60
        )
        assert weights.status_code == 400 and "lora_weights: missing" in weights.text
        # the seeds' client flow: --lora-task-id on tensorrt_llm_bls (gRPC), against the same request over HTTP
        image_path = tmp_path / "page.png"
        make_test_image(5).save(image_path)
        printed = {task: _client_text(server, str(image_path), text, task) for task in (None, "7")}
        http = httpx.post(
            bls,
            json={
                "text_input": text,
                "max_tokens": 8,
                "top_k": 1,
                "lora_task_id": 7,
                "image_url_input": image_to_data_uri(make_test_image(5)),
            },
            timeout=60,
        )
    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", lora_modules=lora_adapters)
    for name in ("alpha", "beta"):
        want = llm.generate(
            [{"prompt": text, "lora": name}], SamplingParams(max_tokens=8, temperature=0)
        )[0]
        assert got[name] == want.outputs[0].text
    assert got["alpha"] != got["beta"] and task7 == got["alpha"]
    assert printed["7"] == http.json()["text_output"] != printed[None]


def _client_text(server, image: str, text: str, task: str | None) -> str:
    """The text `mmserve client --use_bls` prints for one request (its `[beam 0 ]:` line)."""
    extra = ["--lora-task-id", task] if task is not None else []
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmserve.entrypoints.cli",
            "client",
            "--url",
            server.grpc_url,
            "--model_type",
            "llava",
            "--use_bls",
            "--image",
            image,
            "--text",
            text,
            "--request-output-len",
            "8",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("[beam 0 ]:\n", 1)[1].rsplit("\n[INFO]", 1)[0]
