"""Greedy ids and log-probs of mmserve vs transformers on a tiny random BLIP-2 (OPT) checkpoint.

Covers one image + question, text-only prompts, continuous batching mixing both, prefix-cache hits
on a repeated image, chunked prefill cutting through the 32 query tokens, bad input, and the OPT
backbone's post-LN / projected-embedding variants.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mmserve import LLM, SamplingParams
from mmserve.attention.metadata import AttentionMetadata
from mmserve.models.opt import OPTForCausalLM
from mmserve.models.weights import load_weights
from mmserve.testing import make_test_image
from mmserve.testing.blip2 import make_blip2_checkpoint
from tests.parity.hf_oracle import _load, assert_matches_oracle, check_against_hf, run_staggered

N = 32
GREEDY = SamplingParams(
    max_tokens=N, min_tokens=N, temperature=0.0, logprobs=5
)  # as HF min_new_tokens
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
QUESTION = "Question: which city is this? Answer:"


@pytest.fixture(scope="module")
def blip2_dir(tmp_path_factory) -> str:
    return str(make_blip2_checkpoint(tmp_path_factory.mktemp("tiny_blip2"), preset="tiny", seed=0))


def _prompt(i: int, with_image: bool = True) -> dict:
    text = (
        QUESTION
        if i == 0
        else f"Question: what is number {i}? " + "Tell me. " * (i % 3) + "Answer:"
    )
    return {"prompt": text, "images": [make_test_image(10 * i)] if with_image else []}


def _hf_text_greedy(
    model_dir: str, prompt: str, n: int, device: str
) -> tuple[list[int], list[int], torch.Tensor]:
    """BLIP-2's generate needs an image; a text-only prompt is plain OPT generation."""
    model, processor = _load(model_dir, device)
    ids = processor.tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        out = model.language_model.generate(
            input_ids=ids,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    logprobs = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), dim=-1).cpu()
    return ids[0].tolist(), out.sequences[0, ids.shape[1] :].tolist(), logprobs


def _check(model_dir: str, prompt: dict, out, device: str = "cpu") -> None:
    if prompt["images"]:
        check_against_hf(model_dir, prompt, out, N, device)
    else:
        assert_matches_oracle(out, _hf_text_greedy(model_dir, prompt["prompt"], N, device))


@pytest.mark.parametrize("device", DEVICES)
def test_image_question_matches_transformers(blip2_dir, device):
    llm = LLM(blip2_dir, device=device, dtype="float32")
    prompt = _prompt(0)
    out = llm.generate([prompt], GREEDY)[0]
    image_id = llm.engine.hf_config.image_token_index
    assert (
        out.prompt_token_ids[:32] == [image_id] * 32 and image_id not in out.prompt_token_ids[32:]
    )
    _check(blip2_dir, prompt, out, device)
    # the image really conditions the answer
    other = llm.generate([{"prompt": QUESTION, "images": [make_test_image(7)]}], GREEDY)[0]
    assert other.outputs[0].token_ids != out.outputs[0].token_ids


def test_preprocessed_pixel_values_give_the_image_answer(blip2_dir):
    """The Triton pipeline's blip2 clients send HF-processed pixels (`image_input`) instead of an image."""
    llm = LLM(blip2_dir, device="cpu", dtype="float32")
    prompt = _prompt(0)
    pixels = llm.engine.inputs.processor(images=prompt["images"], return_tensors="pt")[
        "pixel_values"
    ]
    out = llm.generate([{"prompt": prompt["prompt"], "pixel_values": pixels}], GREEDY)[0]
    _check(blip2_dir, prompt, out)


def test_text_only_prompt_matches_opt(blip2_dir):
    llm = LLM(blip2_dir, device="cpu", dtype="float32")
    prompt = _prompt(1, with_image=False)
    _check(blip2_dir, prompt, llm.generate([prompt], GREEDY)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_batch_mixing_image_and_text_requests_with_staggered_arrivals(blip2_dir, device):
    llm = LLM(blip2_dir, device=device, dtype="float32", enable_prefix_caching=False)
    engine = llm.engine
    prompts = [_prompt(i, with_image=i % 3 != 1) for i in range(6)]
    for prompt, out in zip(prompts, run_staggered(engine, prompts, GREEDY)):
        _check(blip2_dir, prompt, out, device)
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_same_image_hits_the_prefix_cache(blip2_dir):
    llm = LLM(blip2_dir, device="cpu", dtype="float32", block_size=4)
    first = llm.generate([_prompt(2)], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0
    # the same picture as a fresh object: its 32 query-token blocks (and the text after) are reused
    again = {"prompt": _prompt(2)["prompt"], "images": [make_test_image(20)]}
    second = llm.generate([again], GREEDY)[0]
    assert second.metrics.num_cached_tokens >= 32
    _check(blip2_dir, again, second)
    # the image comes first, so another image behind the same text shares no block at all
    other = {"prompt": again["prompt"], "images": [make_test_image(99)]}
    third = llm.generate([other], GREEDY)[0]
    assert third.metrics.num_cached_tokens == 0
    _check(blip2_dir, other, third)


def test_chunked_prefill_splitting_the_query_tokens_matches(blip2_dir):
    llm = LLM(
        blip2_dir,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=5,
        enable_prefix_caching=False,
    )
    prompt = _prompt(0)
    # 5-token chunks cut the 32 image tokens at 5, 10, ..., 30: each chunk takes a slice of one encoding
    _check(blip2_dir, prompt, llm.generate([prompt], GREEDY)[0])


def test_two_images_in_one_prompt_are_rejected(blip2_dir):
    llm = LLM(blip2_dir, device="cpu", dtype="float32")
    two = {"prompt": QUESTION, "images": [make_test_image(1), make_test_image(2)]}
    with pytest.raises(ValueError, match="at most one image"):
        llm.generate([two], GREEDY)
    with pytest.raises(ValueError, match="at most one image"):
        llm.engine.model.build_mm_items(llm.engine.hf_config, {}, [], ["a", "b"], [])
    assert not llm.engine.scheduler.waiting and not llm.engine.scheduler.running


@pytest.mark.parametrize(
    "variant",
    [
        {"do_layer_norm_before": False},  # opt-350m: post-LN, no final norm
        {
            "word_embed_proj_dim": 24,
            "tie_word_embeddings": False,
        },  # project_in / project_out, own head
    ],
)
def test_opt_backbone_variants_match_transformers(variant):
    cfg = transformers.OPTConfig(
        vocab_size=96,
        hidden_size=36,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=52,
        max_position_embeddings=64,
        init_std=0.2,
        **variant,
    )
    torch.manual_seed(0)
    ref = transformers.OPTForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in ref.named_parameters():
            if "layer_norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ours = OPTForCausalLM(cfg)
    state = ref.state_dict()
    load_weights(
        ours,
        state.items(),
        ours.weight_renames,
        ours.packed_modules,
        ignore=("lm_head.",) if ours.tied else (),
    )
    ids = torch.randint(0, 96, (11,))
    block, n = 4, 11
    for layer in ours.modules():
        if hasattr(layer, "kv_cache"):
            layer.kv_cache = torch.zeros(2, 3, block, layer.num_kv_heads, layer.head_dim)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
        slot_mapping=torch.arange(n),
        query_start_loc_cpu=[0, n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
        block_size=block,
    )
    with torch.no_grad():
        got = ours.compute_logits(ours(ours.embed_input_ids(ids), torch.arange(n), meta))
        want = ref(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
