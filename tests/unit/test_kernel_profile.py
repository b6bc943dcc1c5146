"""bench/kernel_profile.py: the busy union, idle gaps and kinds of a trace's device events, and the
`--profile-dir` round of `mmserve bench throughput` writing its files (on CPU: no kernels, the wall time), beside
the transformers baseline."""

from __future__ import annotations

import gzip
import json

from mmserve.bench.cli import main
from mmserve.bench.kernel_profile import IDLE_GAP_US, kind_of, summarize


def _ev(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_overlapping_kernels_and_gaps_are_idle():
    events = [
        _ev("triton_poi__decode_kernel", 0, 10),
        _ev("sm90_xmma_gemm_e4m3", 5, 10),  # overlaps the first (PDL): busy 0..15
        _ev("_rms_norm_kernel", 20, 5),  # 5 µs gap
        _ev("Memcpy HtoD", 25 + IDLE_GAP_US + 1, 4, cat="gpu_memcpy"),  # a long gap
        _ev("_rms_norm_kernel", 27 + IDLE_GAP_US, 1),  # inside the copy
    ]
    s = summarize(events, wall_s=0.5)
    assert s.busy_us == 15 + 5 + 4
    assert s.idle_us == 5 + IDLE_GAP_US + 1
    assert (s.long_gaps, s.idle_long_us) == (1, IDLE_GAP_US + 1)
    # [calls, durations, exclusive]: the overlap 5..10 is the earlier kernel's, the later one waited in it
    assert s.kinds["decode attention"] == [1, 10, 10]
    assert s.kinds["GEMM (cuBLAS / CUTLASS)"] == [1, 10, 5]
    assert s.kernels["_rms_norm_kernel"] == [2, 6, 5]  # the second one ran inside the copy
    assert s.kinds["copies / fills"] == [1, 4, 4]
    assert sum(row[2] for row in s.kinds.values()) == s.busy_us
    md = s.markdown()
    assert "| RMSNorm (+residual) | 2 | 0.000 | 20.8 % | 0.000 |" in md and "wall 0.500 s" in md


def test_kernels_fall_into_the_kinds_of_work_they_do():
    assert kind_of("_prefill_kernel_0d1d2d") == "prefill attention (paged)"
    assert kind_of("_silu_and_mul_quant_kernel") == "SiLU-and-mul (+quant)"
    assert kind_of("pytorch_flash::flash_fwd_kernel<...>") == "vision / SDPA attention"
    assert kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "GEMM (cuBLAS / CUTLASS)"
    assert kind_of("_gemv_kernel") == "GEMV (batch 1)"
    assert kind_of("something_else") == "other"


def test_throughput_bench_profiles_one_more_round(tiny_llava_dir, tmp_path):
    prof = tmp_path / "prof"
    rc = main(
        [
            "throughput",
            "--model",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--num-requests",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--warmup",
            "0",
            "--hf-batch-size",
            "2",
            "--out",
            str(tmp_path / "r.json"),
            "--profile-dir",
            str(prof),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["errors"] == [] and result["config"]["profile_dir"] == str(prof)
    assert result["results"]["mmserve"]["profile"] == str(prof / "kernels.md")
    assert "profile" not in result["results"]["hf"]  # the baseline runs as always
    assert (prof / "kernels.md").read_text().startswith("wall ")
    with gzip.open(prof / "trace.json.gz", "rt") as f:
        assert "traceEvents" in json.load(f)
