"""Greedy ids and log-probs of mmserve vs transformers on a tiny random Llama 3.2 Vision (Mllama) checkpoint.

Covers the cross-attention paths: one image; text before the image (positions that attend no image attend
all tiles alike and drop their cross-layer MLP output); two images apart and adjacent (which text attends
which image); images with padding tiles; text-only prompts (cross layers skipped); a staggered batch mixing
them; prefix-cache hits keyed by the picture (also for the text before it); chunked prefill; preemption; and
that a request's image keys/values live exactly as long as the request.
"""

from __future__ import annotations

import pytest

from mmserve import LLM, SamplingParams
from mmserve.models.mllama import image_spans
from mmserve.testing import make_test_image
from mmserve.testing.mllama import make_mllama_checkpoint
from tests.parity.hf_oracle import check_against_hf, run_staggered

N = 24
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
WIDE = (96, 40)  # 2 of 4 tiles: the other two are padding


@pytest.fixture(scope="module")
def mllama_dir(tmp_path_factory) -> str:
    return str(
        make_mllama_checkpoint(tmp_path_factory.mktemp("tiny_mllama"), preset="tiny", seed=0)
    )


def _prompt(text: str, *images) -> dict:
    return {"prompt": "<|begin_of_text|>" + text, "images": list(images)}


def _llm(model_dir: str, device: str = "cpu", **kw) -> LLM:
    return LLM(model_dir, device=device, dtype="float32", **kw)


def test_image_spans_follow_the_hf_processor():
    from transformers.models.mllama.processing_mllama import get_cross_attention_token_mask

    for ids in ([0, 9, 1, 2], [9, 1, 9, 2, 3], [1, 9, 9, 2, 9, 3], [9, 9, 9], [4, 9, 9, 5, 6, 9]):
        want = get_cross_attention_token_mask(ids, 9)
        want = [(a, len(ids) if b == -1 else b) for a, b in want]
        assert image_spans([i for i, t in enumerate(ids) if t == 9], len(ids)) == want, ids


@pytest.mark.parametrize("device", DEVICES)
def test_one_image_matches_transformers(mllama_dir, device):
    llm = _llm(mllama_dir, device)
    prompt = _prompt("<|image|>If I had to write a haiku for this one", make_test_image(1))
    out = llm.generate([prompt], GREEDY)[0]
    check_against_hf(mllama_dir, prompt, out, N, device)
    # the picture really conditions the answer
    other = llm.generate([_prompt(prompt["prompt"][17:], make_test_image(2))], GREEDY)[0]
    assert other.outputs[0].token_ids != out.outputs[0].token_ids


@pytest.mark.parametrize(
    "text",
    [
        "Look at this: <|image|> what is it?",  # text before the image attends no image
        "first <|image|> then <|image|> compare them",  # each image until the next one
        "<|image|><|image|> both, then text",  # adjacent images attend together
    ],
)
def test_image_placement_matches_transformers(mllama_dir, text):
    llm = _llm(mllama_dir)
    images = [
        make_test_image(3 + i, WIDE if i % 2 else (48, 40)) for i in range(text.count("<|image|>"))
    ]
    prompt = _prompt(text, *images)
    check_against_hf(mllama_dir, prompt, llm.generate([prompt], GREEDY)[0], N)


def test_text_only_prompt_matches_transformers(mllama_dir):
    llm = _llm(mllama_dir)
    prompt = _prompt("A plain question without a picture")
    check_against_hf(mllama_dir, prompt, llm.generate([prompt], GREEDY)[0], N)


@pytest.mark.parametrize("device", DEVICES)
def test_staggered_batch_of_image_and_text_requests(mllama_dir, device):
    llm = _llm(mllama_dir, device, enable_prefix_caching=False)
    prompts = [
        _prompt(
            f"request {i} <|image|> says" if i % 3 != 1 else f"request {i} only text",
            *([make_test_image(10 + i, WIDE if i % 2 else (48, 40))] if i % 3 != 1 else []),
        )
        for i in range(6)
    ]
    for prompt, out in zip(prompts, run_staggered(llm.engine, prompts, GREEDY)):
        check_against_hf(mllama_dir, prompt, out, N, device)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.num_blocks


def test_same_picture_hits_the_prefix_cache_other_picture_does_not(mllama_dir):
    llm = _llm(mllama_dir, block_size=4)
    text = "some words before the picture <|image|> and a question after it"
    first = llm.generate([_prompt(text, make_test_image(5))], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    again = _prompt(text, make_test_image(5))  # the same picture as a fresh object
    second = llm.generate([again], GREEDY)[0]
    assert second.metrics.num_cached_tokens >= 8
    check_against_hf(mllama_dir, again, second, N)
    # the text before the picture attends it too: another picture behind the same words shares no block
    other = _prompt(text, make_test_image(6))
    third = llm.generate([other], GREEDY)[0]
    assert third.metrics.num_cached_tokens == 0
    check_against_hf(mllama_dir, other, third, N)


def test_chunked_prefill_and_preemption_match_transformers(mllama_dir):
    prompt = _prompt(
        "words before <|image|> and a longer question after the picture", make_test_image(7, WIDE)
    )
    chunked = _llm(mllama_dir, max_num_batched_tokens=5, enable_prefix_caching=False)
    check_against_hf(mllama_dir, prompt, chunked.generate([prompt], GREEDY)[0], N)
    # a pool too small for all four at once: requests are preempted and recomputed
    tight = _llm(mllama_dir, block_size=4, num_kv_blocks=24, enable_prefix_caching=False)
    prompts = [_prompt(f"q{i} <|image|> go on", make_test_image(20 + i)) for i in range(4)]
    for p, out in zip(prompts, tight.generate(prompts, GREEDY)):
        check_against_hf(mllama_dir, p, out, N)


def test_image_keys_and_values_live_as_long_as_the_request(mllama_dir):
    """A request's image keys/values sit in its blocks of the cross-attention pool from admission to its end (finish
    or abort); the pool's real tiles its generated tokens attend come first."""
    llm = _llm(mllama_dir)
    engine = llm.engine
    pool, blocks = engine.runner.cross_kv, engine.scheduler.cross_blocks
    assert blocks.num_free == pool.num_blocks > 0
    engine.add_request(
        "r", _prompt("<|image|> describe", make_test_image(8, WIDE)), SamplingParams(max_tokens=4)
    )
    engine.add_request(
        "a", _prompt("<|image|> describe", make_test_image(9)), SamplingParams(max_tokens=50)
    )
    engine.step()
    req = engine.requests["r"]
    item = req.mm_items[0]
    tokens = engine.model.cross_kv_tokens(item)
    assert req.cross_kv_written and req.cross_kv_tokens == tokens
    assert len(req.cross_block_ids) == -(-tokens // pool.block_size)
    patches = engine.model.vision_model.num_patches
    real = int(item.data["num_tiles"]) * patches
    assert (
        0 < real < tokens and req.cross_decode_len == real and req.cross_kv_order is None
    )  # real tiles first
    # two images: the generated tokens attend the second one's real tiles, which come first
    two = engine.inputs.process(
        _prompt("<|image|> a <|image|> b", make_test_image(8, WIDE), make_test_image(9))
    )
    first, second = (engine.model.cross_kv_tokens(it) for it in two.mm_items)
    real2 = int(two.mm_items[1].data["num_tiles"]) * patches
    order, n = engine.model.cross_kv_order(two.mm_items, len(two.prompt_token_ids))
    assert n == real2
    assert order.tolist() == list(range(first, first + real2)) + list(range(first)) + list(
        range(first + real2, first + second)
    )
    engine.abort("a")
    while engine.has_unfinished():
        engine.step()
    assert blocks.num_free == pool.num_blocks
    assert req.cross_block_ids is None and not req.cross_kv_written


def test_lora_on_self_attention_layers_matches_and_cross_layers_are_refused(mllama_dir, tmp_path):
    """An adapter on the text model's self-attention layers applies (vs transformers with it merged); one that also
    targets a cross-attention layer (whose rows are a subset of the step's and whose k/v run on the image) is refused."""
    import torch
    import transformers

    from mmserve.testing.lora import make_lora_adapter, merge_lora_into
    from tests.parity.hf_oracle import assert_matches_oracle

    cross = set(
        transformers.AutoConfig.from_pretrained(mllama_dir).text_config.cross_attention_layers
    )
    adapter = make_lora_adapter(tmp_path / "all", mllama_dir, seed=3)
    llm = _llm(mllama_dir)
    with pytest.raises(ValueError, match="cross-attention layer"):
        llm.engine.add_lora("all", str(adapter))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    keep = {
        k: v for k, v in tensors.items() if int(k.split(".layers.")[1].split(".")[0]) not in cross
    }
    assert keep and len(keep) < len(tensors)
    save_file(keep, str(adapter / "adapter_model.safetensors"))
    llm.engine.add_lora("self", str(adapter))
    prompt = _prompt("<|image|> describe it", make_test_image(9))
    out = llm.generate([{**prompt, "lora": "self"}], GREEDY)[0]
    model = transformers.MllamaForConditionalGeneration.from_pretrained(
        mllama_dir, dtype=torch.float32
    ).eval()
    merge_lora_into(model, adapter)
    processor = transformers.AutoProcessor.from_pretrained(mllama_dir)
    enc = processor(text=prompt["prompt"], images=prompt["images"], return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(
            **enc,
            max_new_tokens=N,
            min_new_tokens=N,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    n = enc["input_ids"].shape[1]
    assert_matches_oracle(
        out,
        (
            enc["input_ids"][0].tolist(),
            ref.sequences[0, n:].tolist(),
            torch.log_softmax(torch.stack(ref.scores)[:, 0].float(), dim=-1),
        ),
    )
