"""`mmserve quantize`: check the family, load the checkpoint for serving (`mmserve.LLM`, eager, no prefix
cache: every calibration token runs the decoder), collect the decoder linears' input statistics on the
calibration samples, choose the smoothing scales (AWQ's search or SmoothQuant's formula), free the model and
write the quantized checkpoint shard by shard (quantize/writer.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mmserve.quantize.awq import SearchResult, quantize_awq, search_scales
from mmserve.quantize.calibration import (
    InputStats,
    builtin_samples,
    collect_input_stats,
    load_calibration_file,
)
from mmserve.quantize.layout import (
    SUPPORTED_FAMILIES,
    CheckpointLayout,
    Site,
    decoder_sites,
    unsupported_reason,
)
from mmserve.quantize.options import QuantizeOptions
from mmserve.quantize.smoothquant import quantize_int8_per_channel, smoothquant_scales
from mmserve.quantize.writer import Folding, awq_config, w8a8_config, write_checkpoint

logger = logging.getLogger(__name__)
AWQ_PACK = 8  # AutoAWQ packs 8 output rows' nibbles per int32


@dataclass
class QuantizeReport:
    """What one run did: where it wrote, how many linears, on how many calibration tokens, how long."""

    out: Path
    method: str
    linears: int
    samples: int
    tokens: int
    seconds: float
    alphas: dict[str, float] = field(
        default_factory=dict
    )  # AWQ: the chosen alpha per site (its producer)


def check_family(model_dir: str) -> None:
    """ValueError naming the family when calibrated quantization cannot fold into its decoder; checked on a
    model built on the meta device (no memory, no weights), before anything is loaded. A family whose
    constructor needs real tensors is checked once loaded (`check_model`)."""
    from mmserve.models.loader import load_hf_config
    from mmserve.models.registry import get_model_class

    config = load_hf_config(model_dir)
    try:
        with torch.device("meta"):
            model = get_model_class(config)(config)
    except (
        NotImplementedError,
        RuntimeError,
    ):  # e.g. a constructor copying out of a tensor it built
        return
    check_model(model)


def check_model(model: nn.Module) -> None:
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(
            f"family {model.family.name!r} is not supported by mmserve quantize ({reason}); "
            f"supported: {SUPPORTED_FAMILIES}"
        )


def open_for_calibration(model_dir: str, opts: QuantizeOptions):
    """The checkpoint as `serve` runs it, with every prompt token through the decoder (no prefix cache, no
    prompt-end cache) and eager steps (forward hooks do not run inside CUDA graphs)."""
    from mmserve import LLM

    return LLM(
        model_dir,
        dtype=opts.dtype,
        device=opts.device,
        enforce_eager=True,
        enable_prefix_caching=False,
        prompt_end_cache_size=0,
        kv_cache_memory_fraction=0.5,
        seed=opts.seed,
    )


def stacked_weight(model: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """The consumers' weights one above the other, fp32 [sum N, K]."""
    return torch.cat([model.get_submodule(n).weight.float() for n in names])


def awq_folding(
    model: nn.Module, sites: list[Site], stats: dict[str, InputStats], group_size: int
) -> tuple[Folding, dict[str, SearchResult]]:
    """AWQ's searched scales of every site, and each site's search (by producer)."""
    folding, results = Folding(), {}
    for site in sites:
        first = stats[site.consumers[0]]
        weight = stacked_weight(model, site.consumers)
        result = search_scales(first.rows, first.abs_mean, weight, group_size)
        _add(folding, site, result.scales.cpu())
        results[site.producer if site.shard is None else f"{site.producer}:{site.shard}"] = result
    return folding, results


def smoothquant_folding(
    model: nn.Module, sites: list[Site], stats: dict[str, InputStats], alpha: float
) -> Folding:
    folding = Folding()
    for site in sites:
        weight = stacked_weight(model, site.consumers)
        _add(
            folding, site, smoothquant_scales(stats[site.consumers[0]].abs_max, weight, alpha).cpu()
        )
    return folding


def _add(folding: Folding, site: Site, scales: torch.Tensor) -> None:
    for consumer in site.consumers:
        folding.columns[consumer] = scales
    folding.divisors[(site.producer, site.shard)] = scales


def check_shapes(model: nn.Module, linears: list[str], group_size: int) -> None:
    """ValueError when AutoAWQ's layout cannot hold a decoder linear: K a multiple of group_size, N of 8."""
    for name in linears:
        n, k = model.get_submodule(name).weight.shape
        if group_size != -1 and k % group_size:
            raise ValueError(
                f"group_size {group_size} does not divide in_features {k} of {name}; pass --group-size"
            )
        if n % AWQ_PACK:
            raise ValueError(f"out_features {n} of {name} is not a multiple of {AWQ_PACK}")


def quantize_checkpoint(opts: QuantizeOptions) -> QuantizeReport:
    """Run `mmserve quantize`. ValueError for what the user can fix (family, layout, shapes, data, output)."""
    from mmserve.models.hub import resolve_checkpoint

    start = time.monotonic()
    out = Path(opts.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"out: {opts.out} exists and is not an empty directory")
    model_dir = resolve_checkpoint(opts.model)
    check_family(model_dir)
    samples = (
        load_calibration_file(opts.calib_data, opts.calib_size)
        if opts.calib_data
        else builtin_samples(model_dir, opts.calib_size, opts.seed)
    )
    llm = open_for_calibration(model_dir, opts)
    try:
        model = llm.engine.model
        check_model(model)
        layout = CheckpointLayout(model_dir, model)
        linears = layout.check_decoder(model)
        awq = opts.method == "awq"
        if awq and not opts.fold_only:
            check_shapes(model, linears, opts.group_size)
        rows = opts.sample_rows if awq else 1
        stats = collect_input_stats(
            llm, {n: model.get_submodule(n) for n in linears}, samples, rows, opts.seed
        )
        tokens = stats[linears[0]].tokens
        sites = decoder_sites(model)
        if awq:
            folding, results = awq_folding(model, sites, stats, opts.group_size)
            alphas = {k: r.alpha for k, r in results.items()}
        else:
            keep = [s for s in sites if s.shard is None or (opts.smooth_down and s.shard == 1)]
            folding, alphas = smoothquant_folding(model, keep, stats, opts.alpha), {}
        del stats
    finally:
        llm.close()
        model = llm = None  # the model's memory goes before the checkpoint is written
    if awq:
        quantize, config = (
            (lambda w, dtype: quantize_awq(w, opts.group_size)),
            awq_config(opts.group_size),
        )
    else:
        quantize, config = quantize_int8_per_channel, w8a8_config
    if opts.fold_only:
        quantize, config = None, None
    write_checkpoint(layout, out, set(linears), folding, quantize, config)
    report = QuantizeReport(
        out, opts.method, len(linears), len(samples), tokens, time.monotonic() - start, alphas
    )
    logger.info(
        "quantize %s: %d decoder linears, %d calibration samples (%d tokens), %.1f s -> %s",
        opts.method,
        report.linears,
        report.samples,
        report.tokens,
        report.seconds,
        out,
    )
    return report
