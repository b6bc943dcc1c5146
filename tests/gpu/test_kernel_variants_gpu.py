"""The attention kernels compile once per model configuration: mixed steps with any number of decodes in front
of their prompts (slices of every per-sequence tensor), any block-table width and any split count reuse the
first compiled variants. A variant first needed mid-serving compiles for ~0.7 s and stalls every request."""

from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu


def _compiled(jit_fn) -> int:
    """Compiled variants of a Triton kernel (its per-device kernel caches)."""
    return sum(len(caches[0]) for caches in jit_fn.device_caches.values())


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float8_e4m3fn])
def test_mixed_steps_reuse_the_first_compiled_variants(cache_dtype):
    from mmserve.attention import triton_backend
    from mmserve.kernels import paged_attention as kernels
    from mmserve.kernels import paged_decode, paged_decode_kernels
    from tests.kernels.attention_checks import make_batch

    dev = torch.device("cuda")
    watched = [
        kernels._prefill_kernel,
        paged_decode_kernels._decode_kernel,
        paged_decode_kernels._decode_rows_kernel,
        paged_decode_kernels._decode_reduce_kernel,
    ]
    counts = None
    # every 16-byte alignment of the prompts' int32 slices; from ROWS_MIN_BATCH decodes an fp8 cache takes the
    # CUDA-core decode kernel, so both decode kernels are exercised on that side
    start = paged_decode.ROWS_MIN_BATCH if cache_dtype == torch.float8_e4m3fn else 1
    for num_decodes in range(start, start + 7):
        for extra_blocks in (
            0,
            5,
        ):  # block-table widths that are and are not multiples of 4 entries
            ctx = [40 + 97 * i for i in range(num_decodes)] + [300, 70]
            q, _, _, cache, meta = make_batch(
                [1] * num_decodes + [13, 9],
                ctx,
                8,
                8,
                64,
                16,
                torch.float16,
                dev,
                extra_blocks=extra_blocks,
                seed=num_decodes,
                cache_dtype=cache_dtype,
            )
            triton_backend.paged_attention(q, cache, replace(meta, num_decodes=num_decodes), 0.125)
            torch.cuda.synchronize()
            now = [_compiled(k) for k in watched]
            counts = counts or now
            assert now == counts, (
                f"{num_decodes} decodes, {extra_blocks} extra blocks compiled a new variant"
            )
