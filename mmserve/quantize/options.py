"""`mmserve quantize`'s settings (`QuantizeOptions`, checked in `__post_init__`) and its command line, generated from
the dataclass's fields as `serve`'s are (entrypoints/config_flags.py: each flag also MMSERVE_QUANTIZE_<FLAG> and a
key of `--config FILE.yaml`). Imports no torch: the command line answers `-h` and bad arguments at once."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mmserve.entrypoints.config_flags import ConfigError, add_flags, flags_of, resolve

METHODS = ("awq", "smoothquant")
ENV_PREFIX = "MMSERVE_QUANTIZE_"


@dataclass
class QuantizeOptions:
    """What to quantize, how, and on what calibration data."""

    model: str = field(
        default="",
        metadata=dict(help="the checkpoint to quantize: a directory or a hub model ID"),
    )
    out: str = field(
        default="", metadata=dict(help="the directory to write the quantized checkpoint to")
    )
    method: str = field(
        default="awq",
        metadata=dict(
            help="awq: int4 weights in groups with activation-aware scales (AutoAWQ's GEMM layout); "
            "smoothquant: int8 weights per channel and int8 activations per token (compressed-tensors W8A8)"
        ),
    )
    calib_size: int = field(
        default=32, metadata=dict(help="calibration samples (prompt + pictures) to run")
    )
    calib_data: str | None = field(
        default=None,
        metadata=dict(
            help='a JSONL file, one {"prompt": ..., "images": [local paths]} per line; default: the '
            "built-in set of synthetic pictures and varied questions"
        ),
    )
    group_size: int = field(
        default=128, metadata=dict(help="awq: input columns per int4 group (scale and zero point)")
    )
    alpha: float = field(
        default=0.5,
        metadata=dict(help="smoothquant: migration strength, in [0, 1] (0: no smoothing)"),
    )
    smooth_down: bool = field(
        default=False,
        metadata=dict(
            help="smoothquant: also smooth up_proj -> down_proj (the paper smooths norms only)"
        ),
    )
    sample_rows: int = field(
        default=256,
        metadata=dict(
            help="awq: input rows kept per decoder linear for the scale search (a uniform sample of all "
            "calibration tokens; memory: rows x in_features x 4 bytes per linear)"
        ),
    )
    fold_only: bool = field(
        default=False,
        metadata=dict(
            help="write the smoothed checkpoint in the model's dtype without quantizing it (checks the "
            "folding: it serves the same logits as the original)"
        ),
    )
    device: str = field(
        default="auto",
        metadata=dict(help="where calibration runs: auto (cuda if present), cuda, cpu"),
    )
    dtype: str = field(
        default="auto",
        metadata=dict(help="the calibration forward's dtype (auto: the checkpoint's)"),
    )
    seed: int = field(default=0, metadata=dict(help="seed of the built-in set and the row sample"))

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: the checkpoint to quantize is required")
        if not self.out:
            raise ValueError("out: the output directory is required")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.calib_size < 1:
            raise ValueError(f"calib_size must be >= 1, got {self.calib_size}")
        if self.calib_data is not None and not Path(self.calib_data).is_file():
            raise ValueError(f"calib_data: no such file {self.calib_data!r}")
        if self.group_size < 8 and self.group_size != -1:
            raise ValueError(
                f"group_size must be >= 8 (or -1: one group per row), got {self.group_size}"
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.sample_rows < 1:
            raise ValueError(f"sample_rows must be >= 1, got {self.sample_rows}")
        if Path(self.out).resolve() == Path(self.model).resolve():
            raise ValueError("out must not be the model's own directory")


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        print(f"mmserve quantize: error: {message}", file=sys.stderr)
        sys.exit(2)


FLAGS = flags_of(
    QuantizeOptions,
    "quantize",
    model=dict(option="model"),
    out=dict(option="out"),
    method=dict(choices=METHODS),
    smooth_down=dict(both=True),
    fold_only=dict(both=True),
)


def parse_quantize_args(argv: Sequence[str]) -> QuantizeOptions:
    """The options of `mmserve quantize MODEL OUT [flags]`; exits 2 with one line for a bad argument."""
    parser = _OneLineParser(
        prog="mmserve quantize",
        description="Calibrate and quantize a checkpoint's decoder linears; write a checkpoint `serve` loads.",
    )
    parser.add_argument("--config", default=None, help="a YAML file of flag values")
    add_flags(parser, FLAGS, {"quantize": "what to quantize, how, on which calibration data"})
    try:
        args = resolve(parser, FLAGS, argv, os.environ, ENV_PREFIX)
        return QuantizeOptions(**{f.field: getattr(args, f.dest) for f in FLAGS})
    except (ConfigError, ValueError, TypeError) as exc:
        parser.error(str(exc))
        raise  # unreachable: error exits
