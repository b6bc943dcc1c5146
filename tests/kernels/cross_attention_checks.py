"""Checks of cross-attention over the cross-attention pool (worker/cross_kv.py, layers/cross_attention.py): the
decodes through each backend's paged decode attention, the other sequences gathered from their blocks, against
SDPA over the encoder keys/values as they were before they went into the pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.kernels.check_registry import assert_close, check


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """q [R, H, D] over k/v [T, KVH, D] (mask [R, T] True = attend), in fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k, v, scale=scale, attn_mask=None if mask is None else mask[None]
    )
    return o.transpose(0, 1)


def _run(device: torch.device, dtype: torch.dtype, backend_name: str) -> None:
    from mmserve.attention import torch_backend, triton_backend
    from mmserve.attention.metadata import CrossAttentionBatch, CrossAttentionSeq
    from mmserve.layers.cross_attention import attend_cross
    from mmserve.models.base import CrossKVLayout
    from mmserve.worker.cross_kv import CrossKVPool
    from mmserve.worker.request_inputs import decode_metadata

    backend = triton_backend if backend_name == "triton" else torch_backend
    g = torch.Generator().manual_seed(0)
    layers, heads, kv_heads, head_dim, bs = 2, 4, 2, 32, 16
    pool = CrossKVPool(CrossKVLayout(layers, kv_heads, head_dim), dtype, 24, bs, device)
    # (encoder tokens, rows this step, decode length or None for a prompt chunk, order or None); the last one's
    # pool order puts columns 30.. first, as a family's cross_kv_order would for the tokens its decodes attend
    lengths = [37, 50, 21, 45]
    states = [torch.randn(n, layers, 2, kv_heads, head_dim, generator=g).to(dtype) for n in lengths]
    order = torch.cat([torch.arange(30, 45), torch.arange(30)])
    blocks, free = [], list(range(23, -1, -1))  # handed out high ids first: tables are not ranges
    for s, o in zip(states, [None, None, None, order]):
        ids = [free.pop(0) for _ in range(pool.num_blocks_of(len(s)))]
        pool.write((s if o is None else s[o]).to(device), ids)
        blocks.append(ids)
    decodes = [(0, 37), (1, 20), (3, 15)]  # (sequence, tokens its generated token attends)
    prompt_rows, mask = 5, torch.rand(5, 21, generator=g) < 0.6
    mask[:, 0] = True
    rows = [1] * len(decodes) + [prompt_rows]
    q = torch.randn(sum(rows), heads, head_dim, generator=g).to(dtype).to(device)
    starts = [sum(rows[:i]) for i in range(len(rows))]
    seqs = [
        CrossAttentionSeq(slice(a, a + n), 0, 1, [], None, lengths[i])
        for (i, _), a, n in zip(decodes, starts, rows)
    ]
    seqs.append(
        CrossAttentionSeq(
            slice(starts[-1], starts[-1] + prompt_rows),
            0,
            9,
            [],
            torch.tensor(blocks[2], device=device),
            21,
        )
    )
    meta = decode_metadata([blocks[i] for i, _ in decodes], [n for _, n in decodes], bs, device)
    batch = CrossAttentionBatch(seqs, pool.caches, len(decodes), meta, backend)
    scale = head_dim**-0.5
    for layer in range(layers):
        got = attend_cross(q, batch, layer, scale, [mask.to(device)])
        want = []
        for r, (i, n) in enumerate(decodes):
            cols = torch.arange(n) if i != 3 else order[:n]
            s = states[i][cols, layer]
            want.append(_reference(q[r : r + 1].cpu(), s[:, 0], s[:, 1], None, scale))
        s = states[2][:, layer]
        want.append(_reference(q[len(decodes) :].cpu(), s[:, 0], s[:, 1], mask, scale))
        assert_close(got.cpu(), torch.cat(want).to(dtype), f"{backend_name} {dtype} layer {layer}")


@check
def check_cross_attention_pool_decodes_and_prompts(device):
    for dtype in (torch.float32, torch.float16):
        for name in ("torch", "triton"):
            _run(device, dtype, name)


@check
def check_decode_with_a_distance_bias(device):
    """T5-style decoders' decodes: the CUDA-core kernel adds a bias by the key's distance from the query (one
    sequence and many, with and without split-K, fp32 and fp16, a padding row), against the torch backend."""
    from mmserve.attention import torch_backend, triton_backend
    from mmserve.kernels import paged_decode
    from mmserve.models.t5 import relative_position_bucket
    from tests.kernels.attention_checks import make_batch, real_rows

    for ctx, dtype, splits in (
        ([37], torch.float32, None),
        ([5, 90, 33, 17, 64, 120, 8, 49, 70], torch.float16, 3),
        ([130, 3], torch.float32, 1),
    ):
        q, _, _, cache, meta = make_batch(
            [1] * len(ctx), ctx, 4, 4, 64, 16, dtype, device, num_pad_rows=1
        )
        buckets = relative_position_bucket(-torch.arange(256), False, 32, 128)
        table = (
            torch.randn(32, 4, generator=torch.Generator().manual_seed(1))[buckets]
            .t()
            .contiguous()
            .to(device)
        )
        end, sub = real_rows(meta, len(ctx))
        got = paged_decode.paged_decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, 1.0, splits, distance_bias=table
        )
        want = torch_backend.paged_attention(q[:end], cache, sub, 1.0, distance_bias=table)
        assert_close(got[:end], want, f"biased decode {ctx}")
        assert torch.equal(got[end:], torch.zeros_like(got[end:])), "padding rows must be zero"
        assert_close(
            triton_backend.paged_attention(q[:end], cache, sub, 1.0, distance_bias=table),
            want,
            "biased decode through the backend",
        )


@check
def check_t5_decoder_steps_through_the_triton_backend(device):
    """A Deplot (Pix2Struct) checkpoint generates the same tokens with the triton backend (decodes through the
    distance-biased decode kernel, from a bias table of one distance up) as with the torch backend's padded path."""
    import tempfile

    from mmserve import LLM, SamplingParams
    from mmserve.testing import make_test_image
    from mmserve.testing.pix2struct import make_pix2struct_checkpoint

    model_dir = tempfile.mkdtemp()
    make_pix2struct_checkpoint(model_dir, preset="tiny", seed=0, progress=False)
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)
    prompts = [
        {"prompt": "Which year?", "images": [make_test_image(i, (60 + 9 * i, 80))]}
        for i in range(3)
    ]
    runs = []
    for backend in ("torch", "triton"):
        llm = LLM(
            model_dir,
            device=device.type,
            dtype="float32",
            max_num_seqs=4,
            attention_backend=backend,
            enforce_eager=True,
        )
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1], runs
