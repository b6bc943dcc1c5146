"""Time the Qwen2-VL / Qwen2.5-VL vision tower alone on one picture, on CUDA in bf16 (issue 35).

`python scripts/vision_tower_profile.py` builds the qwen2.5-vl-7b preset's tower (random weights, the real
shapes), sizes a 1440x1440 picture's patch grid as the processor does, and times the tower on it with CUDA
events (warm-up, then the median of several calls) along two attention paths: one varlen flash call per block
(the CUDA default) and one SDPA call per run of equal-length segments (the CPU path; before and after in one
call). It prints each path's time against the tower's FLOP floor at --peak TFLOP/s, then a torch.profiler table
of the top kernels of one call of the default path. `--sdpa-runs` times and profiles the SDPA path alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mmserve.layers.linear import LinearBase
from mmserve.models.qwen2_vl_vision import Qwen2VisionTransformer, window_order
from mmserve.testing.qwen2_vl import qwen2_vl_config


def grid_of(config, height: int, width: int) -> list[int]:
    """(t, h, w) in patches of one picture after the processor's resize (sides to multiples of patch * merge)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    v = config.vision_config
    factor = v.patch_size * v.spatial_merge_size
    h, w = smart_resize(
        height, width, factor=factor, min_pixels=56 * 56, max_pixels=28 * 28 * 16384
    )
    return [1, h // v.patch_size, w // v.patch_size]


def tower_flops(tower: Qwen2VisionTransformer, grid: list[int]) -> float:
    """2 x the multiply-adds of one call: patch embedding, every block's matmuls and attention, the merger."""
    t, h, w = grid
    n, merged = t * h * w, t * h * w // tower.merge**2
    dim = tower.blocks[0].attn.proj.in_features
    frames = [h * w] * t
    windows = frames
    if tower.window is not None:
        windows = window_order([grid], tower.merge, tower.window)[1]
    flops = 2 * n * tower.patch_embed.proj.weight[0].numel() * dim
    for i, block in enumerate(tower.blocks):
        flops += 2 * n * _weights(block)
        segments = frames if i in tower.full_blocks else windows
        flops += 4 * dim * sum(length * length for length in segments)  # q k^T and p v
    return flops + 2 * merged * _weights(tower.merger)


def _weights(module: torch.nn.Module) -> int:
    return sum(
        m.in_features * m.out_features for m in module.modules() if isinstance(m, LinearBase)
    )


def build_tower(preset: str, seed: int) -> Qwen2VisionTransformer:
    config = qwen2_vl_config(preset)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        tower = Qwen2VisionTransformer(config.vision_config).to(torch.bfloat16)
    for name, p in tower.named_parameters():
        if p.dim() == 1 and ("norm" in name or "ln_q" in name):
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            p.normal_(0.0, 0.02)
    return tower.eval()


def time_tower(tower, pixels, grid, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        tower(pixels, [grid])
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tower(pixels, [grid])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", default="qwen2.5-vl-7b", help="qwen2.5-vl-7b | qwen2-vl-7b")
    ap.add_argument("--size", type=int, nargs=2, default=(1440, 1440), metavar=("H", "W"))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--peak", type=float, default=990.0, help="bf16 dense TFLOP/s of the floor")
    ap.add_argument("--sdpa-runs", action="store_true", help="only the SDPA-per-run path")
    ap.add_argument("--rows", type=int, default=15, help="kernels in the profiler table")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    tower = build_tower(args.preset, 0)
    grid = grid_of(qwen2_vl_config(args.preset), *args.size)
    n = grid[0] * grid[1] * grid[2]
    pixels = torch.randn(n, tower.patch_embed.proj.weight[0].numel(), device="cuda")
    flops = tower_flops(tower, grid)
    floor_ms = flops / (args.peak * 1e12) * 1e3
    print(
        f"{args.preset} tower on {torch.cuda.get_device_name()}, torch {torch.__version__}: picture "
        f"{args.size[0]}x{args.size[1]} -> grid {grid}, {n} patches, {n // tower.merge**2} tokens; "
        f"{flops / 1e12:.2f} TFLOP, floor {floor_ms:.1f} ms at {args.peak:.0f} TFLOP/s"
    )
    paths = [False] if args.sdpa_runs else [False, True]
    for varlen in paths:
        tower.varlen = varlen
        t0 = time.perf_counter()
        plan = tower.plan([grid], pixels.device, torch.bfloat16)  # each path's first call builds it
        torch.cuda.synchronize()
        plan_ms = (time.perf_counter() - t0) * 1e3
        if varlen and plan.frames.cu_seqlens is None:
            print("no varlen flash attention in this torch: the tower runs SDPA per run")
        with torch.inference_mode():
            times = time_tower(tower, pixels, grid, args.warmup, args.iters)
        med = statistics.median(times)
        name = "varlen flash, one call per block" if varlen else "SDPA per run of equal segments"
        print(
            f"{name:34s} median {med:7.2f} ms (min {min(times):.2f}, max {max(times):.2f}; "
            f"{floor_ms / med:.0%} of the floor's rate); plan build {plan_ms:.1f} ms (host, once per grid)"
        )
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        tower(pixels, [grid])
        torch.cuda.synchronize()
    print(f"top kernels of one call ({'varlen' if tower.varlen else 'SDPA runs'}):")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
