"""Shared fixtures: tiny random checkpoints (built once per session) and the gpu marker."""

from __future__ import annotations

import json

import pytest
import torch

from mmserve.testing import make_llava_checkpoint


def strict_json(text: str | bytes):
    """json.loads that refuses NaN / Infinity, as strict JSON parsers (JavaScript, Go, Rust) do."""

    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def small_gpu_kv_pools():
    """Tests build many engines in one process (and kernel checks in child processes): on a GPU each
    engine takes 3% of free memory for its KV pool instead of the serving default of 90%."""
    if not torch.cuda.is_available():
        yield
        return
    # cuDNN convolutions default to TF32 even for fp32 tensors. mmserve turns that off for fp32 models
    # (ModelRunner._encode); the transformers oracle gets exact fp32 convolutions too.
    torch.backends.cudnn.allow_tf32 = False
    from mmserve.llm import LLM

    defaults = LLM.__init__.__kwdefaults__
    old = defaults["kv_cache_memory_fraction"]
    defaults["kv_cache_memory_fraction"] = 0.03
    yield
    defaults["kv_cache_memory_fraction"] = old


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory) -> str:
    return str(make_llava_checkpoint(tmp_path_factory.mktemp("tiny_llava"), preset="tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_llava_mha_dir(tmp_path_factory) -> str:
    return str(
        make_llava_checkpoint(tmp_path_factory.mktemp("tiny_llava_mha"), preset="tiny-mha", seed=1)
    )


@pytest.fixture(scope="session")
def lora_adapters(tiny_llava_dir, tmp_path_factory) -> dict[str, str]:
    """Two PEFT adapters of the tiny LLaVA: alpha (rank 4 on every decoder linear), beta (rank 8, rsLoRA, three)."""
    from mmserve.testing.lora import make_lora_adapter

    root = tmp_path_factory.mktemp("lora")
    return {
        "alpha": str(make_lora_adapter(root / "alpha", tiny_llava_dir, seed=1)),
        "beta": str(
            make_lora_adapter(
                root / "beta",
                tiny_llava_dir,
                seed=2,
                rank=8,
                alpha=4.0,
                targets=("q_proj", "v_proj", "down_proj"),
                use_rslora=True,
            )
        ),
    }
