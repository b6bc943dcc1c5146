"""LoRA adapters sent as TensorRT-LLM tensors (lora/trtllm_format.py, LoRAManager.put): the same deltas and tokens
as the PEFT directory they were converted from, refusals naming the tensor and row, and the task cache (a repeat
is a no-op, other weights under a loaded id are refused, the least recently used unheld adapter makes room)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mmserve import LLM, SamplingParams
from mmserve.testing.lora import trtllm_lora_tensors

PROMPTS = ["USER: tell me a story ASSISTANT:", "USER: two words ASSISTANT:"]


@pytest.fixture(scope="module")
def llm(tiny_llava_dir, lora_adapters) -> LLM:
    return LLM(
        tiny_llava_dir, device="cpu", dtype="float32", lora_modules=lora_adapters, max_loras=4
    )


def _targets(adapter) -> dict[str, list[tuple]]:
    return {k: sorted((t.offset, t.size, t.a, t.b) for t in v) for k, v in adapter.targets.items()}


@pytest.mark.parametrize("peft", ["alpha", "beta"])
def test_tensors_give_the_peft_adapter_s_deltas_and_tokens(llm, lora_adapters, peft):
    weights, config = trtllm_lora_tensors(lora_adapters[peft], torch.float32)
    name = f"task-{peft}"
    llm.engine.add_lora_tensors(name, weights.numpy(), config.numpy())
    want, got = _targets(llm.engine.lora.get(peft)), _targets(llm.engine.lora.get(name))
    assert want.keys() == got.keys()
    for module, parts in want.items():
        for (o1, s1, a1, b1), (o2, s2, a2, b2) in zip(parts, got[module], strict=True):
            assert (o1, s1) == (o2, s2)
            torch.testing.assert_close(a2, a1, rtol=0, atol=0)
            torch.testing.assert_close(b2, b1, rtol=1e-6, atol=1e-7)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = llm.generate(
        [{"prompt": p, "lora": n} for p in PROMPTS for n in (peft, name, None)],
        params,
        use_tqdm=False,
    )
    ids = [o.outputs[0].token_ids for o in outs]
    assert ids[0] == ids[1] and ids[3] == ids[4]
    assert ids[0] != ids[2] or ids[3] != ids[5]  # the adapter changes the answers
    llm.engine.lora.remove(name)


def _config(rows: list[list[int]]) -> np.ndarray:
    return np.array(rows, dtype=np.int32)


def test_rows_that_do_not_fit_are_refused_naming_the_tensor_and_row(llm):
    hidden = (
        llm.engine.lora.get("alpha")
        .targets["language_model.model.layers.0.self_attn.o_proj"][0]
        .a.shape[1]
    )
    layers = len(llm.engine.model.language_model.model.layers)
    ok = np.zeros((1, 2 * 2 * hidden), dtype=np.float16)
    cases = [
        (
            ok,
            _config([[9, 0, 2]]),
            "lora_config row 0 (module 9, layer 0, adapter size 2): module id 9 is not supported",
        ),
        (
            ok,
            _config([[1, 99, 2]]),
            f"lora_config row 0 (module 1, layer 99, adapter size 2): the model has {layers} decoder layers",
        ),
        (ok, _config([[1, 0, 0]]), "the adapter size must be >= 1"),
        (
            ok[:, :10],
            _config([[4, 0, 2]]),
            "lora_weights row 0: attn_dense of layer 0 with adapter size 2 needs",
        ),
        (
            np.zeros((2, 4 * hidden), np.float16),
            _config([[1, 0, 2], [1, 0, 2]]),
            "lora_config row 1 (module 1, layer 0, adapter size 2): this module of this layer has an earlier row",
        ),
        (ok, _config([[1, 0]]), "lora_config: expected [rows, 3]"),
        (np.zeros((2, 8), np.float16), _config([[1, 0, 2]]), "lora_weights: expected [1, width]"),
        (ok.astype(np.int32), _config([[1, 0, 2]]), "lora_weights: expected floating-point values"),
    ]
    for weights, config, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.engine.add_lora_tensors("bad", weights, config)
    assert "bad" not in llm.engine.lora.adapters


def test_task_cache_repeats_conflicts_and_evicts_the_least_recently_used(
    tiny_llava_dir, lora_adapters
):
    llm = LLM(
        tiny_llava_dir,
        device="cpu",
        dtype="float32",
        lora_modules={"alpha": lora_adapters["alpha"]},
        max_loras=3,
    )
    lora = llm.engine.lora
    w, c = (t.numpy() for t in trtllm_lora_tensors(lora_adapters["alpha"], torch.float16))
    w2, c2 = (t.numpy() for t in trtllm_lora_tensors(lora_adapters["beta"], torch.float16))
    llm.engine.add_lora_tensors("1", w, c)
    first = lora.get("1")
    llm.engine.add_lora_tensors("1", w, c)  # the same weights again: kept as is
    assert lora.get("1") is first
    with pytest.raises(ValueError, match="lora_weights: LoRA task 1 is loaded with other weights"):
        llm.engine.add_lora_tensors("1", w2, c2)
    llm.engine.add_lora_tensors("2", w2, c2)  # slots: alpha (startup), 1, 2
    lora.get("1")  # 1 used after 2: 2 is now the least recent
    llm.engine.add_lora_tensors("3", w, c)
    assert sorted(lora.adapters) == ["1", "3", "alpha"]  # 2 made room; the startup adapter stays
    # a request holding an adapter keeps it: 1 is held, so 3 (unheld) makes room for 4
    llm.engine.add_request("r", {"prompt": PROMPTS[0], "lora": "1"}, SamplingParams(max_tokens=4))
    lora.get("3")
    llm.engine.add_lora_tensors("4", w2, c2)
    assert sorted(lora.adapters) == ["1", "4", "alpha"]
    llm.engine.add_request("s", {"prompt": PROMPTS[1], "lora": "4"}, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="lora_task_id: all 3 LoRA adapter slots"):
        llm.engine.add_lora_tensors("5", w, c)
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.add_lora_tensors("5", w, c)  # nothing held now: 1 or 4 goes
    assert len(lora.adapters) == 3 and "5" in lora.adapters and "alpha" in lora.adapters
