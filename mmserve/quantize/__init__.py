"""Calibrated quantization without a build step: `mmserve quantize MODEL OUT --method awq | smoothquant` runs
calibration samples (prompts with pictures) through the served model, chooses per-channel smoothing scales,
folds them into the checkpoint and writes it quantized in a layout other tools read (AutoAWQ's GEMM layout;
compressed-tensors W8A8), which `mmserve serve` loads.

Modules: `options` (the settings and command line, torch-free), `calibration` (samples, input statistics),
`layout` (supported families, smoothing sites, our names -> the checkpoint's), `awq`, `smoothquant` (the scales
and the weights' quantization), `writer` (the checkpoint on disk), `run` (the whole command).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """`mmserve quantize ...`: 0 when written; 2 with one line on stderr for a bad argument, family, layout or
    calibration file."""
    from mmserve.quantize.options import parse_quantize_args

    opts = parse_quantize_args(argv)
    from mmserve.quantize.run import quantize_checkpoint

    try:
        report = quantize_checkpoint(opts)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mmserve quantize: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{report.out}: {report.method}, {report.linears} decoder linears, {report.samples} calibration "
        f"samples ({report.tokens} tokens), {report.seconds:.1f} s"
    )
    return 0
