"""Triton kernels vs the torch oracle at small shapes; each check raises AssertionError on a mismatch.

Run as `python -m tests.kernels.triton_checks [names...]` (TRITON_INTERPRET=1 on CPU, set by the caller
before triton is imported); the last stdout line is `RESULTS <json>` mapping each check to None or its error.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

from tests.kernels import attention_checks, cross_attention_checks, sampling_checks  # noqa: F401  (register them)
from tests.kernels.check_registry import (
    CHECKS,
    INTERPRET,
    TOLERANCE,
    assert_close,
    check,
    interpreter_fp8_rounding,
)

# --------------------------------------------------------------------------------------------- torch references
# Explicit formulas in fp32, independent of mmserve's layers: on CUDA RMSNorm, RotaryEmbedding and SiluAndMul
# dispatch to the very Triton kernels under test, so a layer is no reference there. Compare a kernel's output
# (in its dtype) with these at TOLERANCE[dtype] (also used by tests/gpu/test_triton_kernels_gpu.py).


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rotary_reference(
    positions: torch.Tensor, x: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0
) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] at positions [T], in fp32: angle = position * inv_freq [D / 2], the first
    half of each head turned with the second (x1 cos - x2 sin, x2 cos + x1 sin); cos / sin times scaling."""
    angle = (
        positions.float()[:, None] * inv_freq.float().to(positions.device)[None, :]
    )  # [T, D / 2]
    cos, sin = (angle.cos() * scaling)[:, None], (angle.sin() * scaling)[:, None]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[gate | up] -> gate * sigmoid(gate) * up, in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


# --------------------------------------------------------------------------------------------- fused ops


@check
def check_rms_norm_with_and_without_residual(device):
    from mmserve.kernels.fused_ops import rms_norm

    eps = 1e-5
    for dtype in (torch.float32, torch.float16):
        gen = torch.Generator().manual_seed(1)
        weight = torch.randn(40, generator=gen).to(device=device, dtype=dtype)
        x = torch.randn(2, 3, 40, generator=gen).to(device=device, dtype=dtype)
        res = torch.randn(2, 3, 40, generator=gen).to(device=device, dtype=dtype)
        tol = TOLERANCE[dtype]
        assert_close(
            rms_norm(x, weight, eps), rms_norm_reference(x, weight, eps), f"rms_norm {dtype}", tol
        )
        # layouts the kernel cannot index directly: every other column of a wider tensor, and a residual
        # stored column-major (both taken as row-major copies; the residual sum comes back row-major)
        wide = torch.randn(2, 3, 80, generator=gen).to(device=device, dtype=dtype)
        res_t = res.transpose(0, 2).contiguous().transpose(0, 2)
        normed, summed = rms_norm(wide[..., ::2], weight, eps, res_t)
        want_sum = wide[..., ::2].float() + res.float()
        assert_close(summed, want_sum, f"rms_norm strided residual sum {dtype}", tol)
        assert_close(
            normed, rms_norm_reference(want_sum, weight, eps), f"rms_norm strided {dtype}", tol
        )
        got, got_res = rms_norm(x, weight, eps, residual=res)
        summed = x + res  # the residual stream: the sum rounded to x's dtype, then normalised
        assert torch.equal(got_res, summed), f"residual sum {dtype}"
        assert_close(
            got, rms_norm_reference(summed, weight, eps), f"rms_norm+residual {dtype}", tol
        )


@check
def check_rotary_in_place_matches_layer(device):
    # the kernel over RotaryEmbedding's tables (as the layer calls it on CUDA) against rotate-half RoPE with cos /
    # sin computed here from inv_freq: checks the tables' layout (cat(freqs, freqs), scaling folded in) too
    from mmserve.kernels.fused_ops import apply_rotary_
    from mmserve.layers.rotary import RotaryEmbedding

    for dtype, head_dim in [(torch.float32, 20), (torch.float16, 64)]:
        gen = torch.Generator().manual_seed(2)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        rope = RotaryEmbedding(inv_freq, 64, scaling=0.9).to(device)
        positions = torch.randint(0, 64, (5,), generator=gen)
        qkv = torch.randn(5, 7 * head_dim, generator=gen).to(dtype)
        want_q = rotary_reference(
            positions, qkv[:, : 4 * head_dim].view(5, 4, head_dim), inv_freq, 0.9
        )
        want_k = rotary_reference(
            positions, qkv[:, 4 * head_dim : 6 * head_dim].view(5, 2, head_dim), inv_freq, 0.9
        )
        qkv = qkv.to(device)
        q, k = (
            qkv[:, : 4 * head_dim].view(5, 4, head_dim),
            qkv[:, 4 * head_dim : 6 * head_dim].view(5, 2, head_dim),
        )
        v_before = qkv[:, 6 * head_dim :].clone()
        got_q, got_k = apply_rotary_(positions.to(device), q, k, rope.cos, rope.sin)
        assert got_q is q and got_k is k, "rotary must work in place"
        assert_close(q.cpu(), want_q, f"rotary q {dtype}", TOLERANCE[dtype])
        assert_close(k.cpu(), want_k, f"rotary k {dtype}", TOLERANCE[dtype])
        assert torch.equal(qkv[:, 6 * head_dim :], v_before), "rotary wrote outside q and k"


@check
def check_mrope_rotary_matches_torch_formula(device):
    # M-RoPE (Qwen2-VL): frequency sections turn with the t, h or w position; positions [3, T] read through a
    # row stride (slices of a persistent [3, max] buffer) or [T] for text-only tokens; the torch formula on CPU
    # is the reference, the kernel runs as the module's CUDA path and as the fused rotary + cache write
    from mmserve.kernels.fused_ops import apply_rotary_
    from mmserve.kernels.paged_attention import reshape_and_cache
    from mmserve.kernels.rotary_cache import rotary_and_cache
    from mmserve.layers.rotary import MRotaryEmbedding
    from tests.kernels.attention_checks import assert_cache_equal, make_batch

    head_dim, tokens = 16, 6
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    rope_cpu = MRotaryEmbedding(inv_freq, 64, [2, 3, 3], scaling=0.9)
    rope = MRotaryEmbedding(inv_freq, 64, [2, 3, 3], scaling=0.9).to(device)
    gen = torch.Generator().manual_seed(4)
    buffer = torch.randint(0, 64, (3, 10), generator=gen)
    for dtype in (torch.float32, torch.float16):
        for positions in (buffer[:, :tokens], buffer[0, :tokens]):
            qkv = torch.randn(tokens, 8 * head_dim, generator=gen).to(dtype)
            q = qkv[:, : 4 * head_dim].view(tokens, 4, head_dim)
            k = qkv[:, 4 * head_dim : 6 * head_dim].view(tokens, 2, head_dim)
            want_q, want_k = rope_cpu(positions, q.clone(), k.clone())
            dq, dk = q.to(device, copy=True), k.to(device, copy=True)
            got_q, got_k = apply_rotary_(
                positions.to(device), dq, dk, rope.cos, rope.sin, rope.axis
            )
            assert_close(
                got_q.cpu(), want_q, f"M-RoPE q {dtype} positions {tuple(positions.shape)}"
            )
            assert_close(
                got_k.cpu(), want_k, f"M-RoPE k {dtype} positions {tuple(positions.shape)}"
            )
            # fused with the cache write: the same bits as the rotary kernel followed by the cache write
            _, _, _, cache, meta = make_batch([tokens], [tokens], 4, 2, head_dim, 4, dtype, device)
            want_cache, out = cache.clone(), torch.empty_like(dq)
            v = torch.randn(tokens, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
            reshape_and_cache(got_k, v, want_cache, meta.slot_mapping)
            rotary_and_cache(
                positions.to(device),
                q.to(device, copy=True),
                k.to(device, copy=True),
                v,
                cache,
                meta.slot_mapping,
                rope.cos,
                rope.sin,
                q_out=out,
                axis=rope.axis,
            )
            assert torch.equal(out, got_q), f"fused M-RoPE q {dtype}"
            assert_cache_equal(cache, want_cache, dtype)


@check
def check_vision_rope_fused_matches_torch_formula(device):
    # Qwen2-VL's tower: 2D (h, w) rotary as the fused kernel with an axis table over positions [2, N], in place on
    # the strided q / k views of the qkv output, against the torch formula of the CPU path; Qwen2.5-VL's window
    # permutation of the positions too
    from mmserve.models.qwen2_vl_vision import VisionRope, VisionRotary, vision_rope_positions

    heads, head_dim = 3, 20
    # two modules: Module.to moves in place, and the CPU formula needs its inv_freq on the CPU
    rotary_cpu, rotary = VisionRotary(head_dim, 10000.0), VisionRotary(head_dim, 10000.0).to(device)
    pos = vision_rope_positions([[1, 4, 6], [2, 2, 2]], 2)  # [N, 2]: two items, 32 patches
    n = len(pos)
    gen = torch.Generator().manual_seed(5)
    perm = torch.randperm(n, generator=gen)
    for dtype in (torch.float32, torch.float16):
        qkv = torch.randn(n, 3 * heads * head_dim, generator=gen).to(dtype)
        q, k, _ = qkv.view(n, 3, heads, head_dim).unbind(1)
        for reorder in (False, True):
            ref = rotary_cpu(pos, torch.device("cpu"))  # the torch formula
            fused = VisionRope(
                pos.T.contiguous().to(device), *rotary.tables(int(pos.max()) + 1), rotary.axis
            )  # what forward gives on CUDA
            assert fused.cos.shape[1] == head_dim // 2 and len(fused.cos) >= int(pos.max()) + 1
            if reorder:
                ref, fused = ref.permute(perm), fused.permute(perm.to(device))
            want_q, want_k = ref.apply(
                q[perm] if reorder else q.clone(), k[perm] if reorder else k.clone()
            )
            dqkv = qkv.to(device, copy=True)
            dq, dk, _ = dqkv.view(n, 3, heads, head_dim).unbind(1)
            dq, dk = (dq[perm.to(device)], dk[perm.to(device)]) if reorder else (dq, dk)
            got_q, got_k = fused.apply(dq, dk)
            assert_close(got_q.cpu(), want_q, f"vision rope q {dtype} reorder={reorder}")
            assert_close(got_k.cpu(), want_k, f"vision rope k {dtype} reorder={reorder}")


@check
def check_silu_and_mul_matches_layer(device):
    from mmserve.kernels.fused_ops import silu_and_mul

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(3, 2, 2 * 50, generator=torch.Generator().manual_seed(3)).to(
            device=device, dtype=dtype
        )
        assert_close(
            silu_and_mul(x), silu_and_mul_reference(x), f"silu_and_mul {dtype}", TOLERANCE[dtype]
        )
        strided = torch.randn(3, 2, 4 * 50, generator=torch.Generator().manual_seed(4)).to(
            device=device, dtype=dtype
        )
        assert_close(
            silu_and_mul(strided[..., ::2]),
            silu_and_mul_reference(strided[..., ::2]),
            f"silu_and_mul strided {dtype}",
            TOLERANCE[dtype],
        )


@check
def check_gemv_matches_linear(device):
    import torch.nn.functional as F

    from mmserve.kernels.gemv import gemv

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n, k, bias in [
            (40, 96, False),
            (33, 1000, True),
            (7, 130, False),
            (5, 40, True),
        ]:  # K < a tile too
            w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype)
            x = torch.randn(1, k, generator=g).to(device=device, dtype=dtype)
            b = torch.randn(n, generator=g).to(device=device, dtype=dtype) if bias else None
            want = F.linear(x.float(), w.float(), b.float() if bias else None).to(dtype)
            # fp32 sums rounded once to the output dtype on both sides: within TOLERANCE (an ulp or two)
            assert_close(gemv(x, w, b), want, f"gemv {n}x{k} {dtype}")
            assert_close(gemv(x[0], w, b), want[0], f"gemv 1-d {n}x{k} {dtype}")


@check
def check_fp8_quant_rows_dynamic_static_one_pass_and_looped(device):
    from mmserve.kernels.fp8_gemm import quant_rows
    from mmserve.layers.fp8_linear import quantize_rows

    g = torch.Generator().manual_seed(5)
    for m, k in [
        (3, 40),
        (2, 200),
        (0, 64),
    ]:  # one pass (the row fits a tile) and the two-pass loop
        x = (torch.randn(m, k, generator=g) * 3).to(device)
        if m:
            x[-1] = 0.0  # an all-zero row keeps a finite scale
        for dtype in (torch.float32, torch.float16):
            for static in (
                None,
                torch.tensor([0.004], device=device),
            ):  # static 0.004: many values saturate
                q, s = quant_rows(x.to(dtype), static)
                want_q, want_s = quantize_rows(x.to(dtype), static)
                assert torch.equal(s, want_s), (
                    f"quant_rows {m}x{k} {dtype} static={static is not None}: scales"
                )
                differs = q.view(torch.uint8) != want_q.view(torch.uint8)
                if INTERPRET:
                    differs &= ~interpreter_fp8_rounding(q, want_q)
                assert not differs.any(), (
                    f"quant_rows {m}x{k} {dtype}: {int(differs.sum())} codes differ"
                )
                assert torch.isfinite(q.float()).all() and (q.float().abs() <= 448).all()


def assert_same_quantized(got, want_y: torch.Tensor, static, what: str) -> None:
    """got (QuantizedRows from a fused kernel) holds exactly quantize_rows(want_y, static)."""
    from mmserve.layers.fp8_linear import quantize_rows

    want_q, want_s = quantize_rows(want_y, static)
    assert got.dtype == want_y.dtype and got.q.shape == want_q.shape, f"{what}: dtype / shape"
    assert torch.equal(got.scale, want_s), f"{what}: scales differ"
    differs = got.q.view(torch.uint8) != want_q.view(torch.uint8)
    if INTERPRET:
        differs &= ~interpreter_fp8_rounding(got.q, want_q)
    assert not differs.any(), f"{what}: {int(differs.sum())} e4m3 codes differ"


@check
def check_rms_norm_and_silu_quantized_outputs_match_unfused(device):
    # the kernels' FP8 outputs are bit for bit quantize_rows of the same kernels' unfused outputs (which
    # check_rms_norm_* and check_silu_* compare with the fp32 torch formulas above), dynamic and static scales
    from mmserve.kernels.fused_ops import rms_norm, silu_and_mul

    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float16):
        w = torch.randn(48, generator=g).to(device=device, dtype=dtype)
        x = (torch.randn(5, 48, generator=g) * 4).to(device=device, dtype=dtype)
        res = torch.randn(5, 48, generator=g).to(device=device, dtype=dtype)
        gate_up = (torch.randn(4, 2 * 40, generator=g) * 3).to(device=device, dtype=dtype)
        for static in (
            None,
            torch.tensor([0.01], device=device),
        ):  # static 0.01: some values saturate
            tag = f"{dtype} static={static is not None}"
            assert_same_quantized(
                rms_norm(x, w, 1e-5, quantize=True, input_scale=static),
                rms_norm(x, w, 1e-5),
                static,
                f"rms_norm {tag}",
            )
            got, got_res = rms_norm(x, w, 1e-5, residual=res, quantize=True, input_scale=static)
            want, want_res = rms_norm(x, w, 1e-5, residual=res)
            assert_same_quantized(got, want, static, f"rms_norm+residual {tag}")
            assert torch.equal(got_res, want_res), f"rms_norm+residual {tag}: residual sum"
            assert_same_quantized(
                silu_and_mul(gate_up, quantize=True, input_scale=static),
                silu_and_mul(gate_up),
                static,
                f"silu_and_mul {tag}",
            )
        empty = silu_and_mul(gate_up[:0], quantize=True)
        assert empty.q.shape == (0, 40) and empty.scale.shape == (0,)


@check
def check_fp8_gemv_and_small_m_gemm_match_reference(device):
    from mmserve.kernels.fp8_gemm import fp8_gemm_small_m, fp8_gemv
    from mmserve.layers.fp8_linear import quantize_rows, quantize_weight

    g = torch.Generator().manual_seed(6)
    for n, k, bias in [(37, 200, True), (16, 40, False), (70, 96, True)]:
        w, ws = quantize_weight(torch.randn(n, k, generator=g) * 0.1)
        b = torch.randn(n, generator=g) if bias else None
        w, ws, b = w.to(device), ws.to(device), (b.to(device) if bias else None)
        for m in (1, 5, 17, 33):
            xq, xs = quantize_rows(torch.randn(m, k, generator=g).to(device))
            want = (xq.float() @ w.float().t()) * xs[:, None] * ws[None, :] + (b if bias else 0.0)
            for out_dtype in (torch.float32, torch.float16):
                got = fp8_gemm_small_m(xq, xs, w, ws, b, out_dtype)
                assert_close(got, want.to(out_dtype), f"fp8 small-M GEMM {m}x{n}x{k} {out_dtype}")
                if m == 1:
                    assert_close(
                        fp8_gemv(xq, xs, w, ws, b, out_dtype),
                        want.to(out_dtype),
                        f"fp8 GEMV {n}x{k} {out_dtype}",
                    )


# --------------------------------------------------------------------------------------------- runner


def main(names: list[str]) -> dict[str, str | None]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, str | None] = {}
    for name in names or list(CHECKS):
        t0 = time.perf_counter()
        try:
            CHECKS[name](device)
            results[name] = None
        except Exception as e:  # report every check, not only the first failure
            results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
        print(
            f"{name}: {'ok' if results[name] is None else 'FAIL'} ({time.perf_counter() - t0:.1f}s)",
            file=sys.stderr,
        )
    return results


if __name__ == "__main__":
    print("RESULTS " + json.dumps(main(sys.argv[1:])))
