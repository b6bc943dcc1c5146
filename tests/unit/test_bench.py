"""`mmserve bench` end to end on CPU with the tiny checkpoint: JSON keys, positive numbers, markdown and plots.

Timings here only have to exist and be positive; their values are never checked (DESIGN §5).
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from mmserve.bench.cli import main
from mmserve.bench.report import write_outputs
from mmserve.bench.roofline import lm_shape
from mmserve.bench.serve import ServeConfig
from mmserve.bench.workload import ModelSource, make_prompt

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAS_FRONTENDS = all(importlib.util.find_spec(f"mmserve.entrypoints.{m}") is not None
                    for m in ("triton_http", "openai_api", "grpc_server"))


def _strict_json(path: Path) -> dict:
    def no_constants(c: str):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(path.read_text(), parse_constant=no_constants)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _outputs(tmp_path: Path) -> list[str]:
    return ["--out", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "b.md"),
            "--plot-dir", str(tmp_path / "plots")]


def _check_env_and_files(tmp_path: Path, result: dict, bench: str, table_header: str) -> None:
    assert result["schema"] == "mmserve-bench/1" and result["bench"] == bench
    env = result["env"]
    assert env["command"].startswith(f"mmserve bench {bench} ") and env["torch"] and env["device_name"] and env["date"]
    assert result["errors"] == []
    md = (tmp_path / "b.md").read_text()
    assert env["command"] in md and table_header in md
    if HAS_MATPLOTLIB:
        assert result["plots"] and all(Path(p).stat().st_size > 0 for p in result["plots"])


def test_latency_bench_measures_mmserve_hf_and_roofline_per_batch_size(tiny_llava_dir, tmp_path):
    rc = main(["latency", "--model", tiny_llava_dir, "--device", "cpu", "--batch-sizes", "1,2", "--input-len", "16",
               "--output-len", "3", "--warmup", "0", "--iters", "1", "--baseline", "hf", *_outputs(tmp_path)])
    assert rc == 0
    result = _strict_json(tmp_path / "r.json")
    _check_env_and_files(tmp_path, result, "latency", "| batch | TTFT ms mmserve |")
    assert _positive(result["bandwidth"]["gb_per_s"])
    assert result["model"]["text_tokens"] == 16
    assert [r["batch_size"] for r in result["results"]] == [1, 2]
    for row in result["results"]:
        for engine in ("mmserve", "hf"):
            m = row[engine]
            for key in ("ttft_ms", "ttft_mean_ms", "decode_ms_per_step", "decode_tok_s", "roofline_fraction"):
                assert _positive(m[key]), (engine, key, m[key])
            assert m["prompt_tokens"] > 16  # the image's placeholders come on top of the text
        assert row["mmserve"]["prompt_tokens"] == row["hf"]["prompt_tokens"]
        assert all(_positive(row["roofline"][k]) for k in ("bytes_per_step", "ms_per_step", "tok_s"))
        assert _positive(row["ratio"]["ttft"]) and _positive(row["ratio"]["decode_tok_s"])


def test_throughput_bench_runs_same_requests_through_llm_generate_and_hf(tiny_llava_dir, tmp_path):
    rc = main(["throughput", "--model", tiny_llava_dir, "--device", "cpu", "--num-requests", "3", "--input-len", "12",
               "--output-len", "4", "--hf-batch-size", "2", "--warmup", "0", *_outputs(tmp_path)])
    assert rc == 0
    result = _strict_json(tmp_path / "r.json")
    _check_env_and_files(tmp_path, result, "throughput", "| engine | requests |")
    res = result["results"]
    for engine in ("mmserve", "hf"):
        assert res[engine]["num_requests"] == 3 and res[engine]["output_tokens"] == 12
        assert all(_positive(res[engine][k]) for k in ("elapsed_s", "requests_per_s", "output_tok_s"))
    assert res["mmserve"]["prompt_tokens"] == res["hf"]["prompt_tokens"]
    assert _positive(res["ratio"]["output_tok_s"]) and _positive(res["ratio"]["requests_per_s"])


def test_preset_checkpoint_is_written_once_then_reused(tmp_path):
    source = ModelSource(preset="tiny", work_dir=str(tmp_path))
    first = Path(source.resolve())
    stamp = (first / "config.json").stat().st_mtime_ns
    assert Path(source.resolve()) == first and (first / "config.json").stat().st_mtime_ns == stamp
    assert not Path(f"{first}.partial").exists()


def test_prompt_has_exactly_the_asked_text_tokens(tiny_llava_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    for n in (16, 40, 128):
        spec = make_prompt(tok, n)
        assert spec.text_tokens == n and spec.text.count("<image>") == 1
        assert len(tok(spec.text).input_ids) - 1 == n


def test_roofline_weight_bytes_match_the_transformers_language_model(tiny_llava_dir):
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir)
    lm = [p for n, p in model.named_parameters()
          if ("language_model" in n or n.startswith("lm_head")) and "embed_tokens" not in n]
    assert lm_shape(tiny_llava_dir, "float32").weight_bytes == sum(p.numel() * 4 for p in lm)
    assert lm_shape(tiny_llava_dir, "float16").weight_bytes == sum(p.numel() * 2 for p in lm)


def test_markdown_file_gets_each_run_appended(tmp_path):
    result = {"bench": "throughput", "schema": "mmserve-bench/1", "errors": [],
              "env": {"date": "d", "command": "mmserve bench throughput x", "device": "cpu"},
              "model": {"preset": "tiny", "dtype": "float32", "text_tokens": 4},
              "config": {"num_requests": 1, "output_len": 2, "max_num_seqs": 1, "hf_batch_size": 1, "rate": math.inf},
              "results": {"mmserve": {"num_requests": 1, "elapsed_s": 1.0, "requests_per_s": 1.0,
                                      "output_tok_s": 2.0, "total_tok_s": 6.0}}}
    md_path, out = tmp_path / "b.md", tmp_path / "r.json"
    write_outputs(result, str(out), str(md_path), None)
    write_outputs(result, str(out), str(md_path), None)
    assert md_path.read_text().count("### `mmserve bench throughput`") == 2
    assert _strict_json(out)["config"]["rate"] == "inf"


def test_bench_refuses_bad_settings_without_a_traceback(capsys):
    assert main(["latency", "--device", "cpu"]) == 2  # neither --model nor --preset
    assert "--model" in capsys.readouterr().err
    with pytest.raises(ValueError):
        ServeConfig("ftp://127.0.0.1:1", protocol="openai")
    with pytest.raises(ValueError):
        ServeConfig("http://127.0.0.1:1", protocol="smtp")
    assert ServeConfig("http://127.0.0.1:8001", protocol="triton-grpc").url == "127.0.0.1:8001"


# ---- serve: a real `mmserve serve` on 127.0.0.1 -------------------------------------------------

@pytest.fixture(scope="module")
def bench_server(tiny_llava_dir, tmp_path_factory):
    if not HAS_FRONTENDS:
        pytest.skip("the HTTP/gRPC frontends are not there yet")
    from tests.server.conftest import start_server

    with start_server(tiny_llava_dir, tmp_path_factory.mktemp("bench-server-logs")) as handle:
        yield handle


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc", "openai"])
def test_serve_bench_sweeps_rate_and_concurrency_against_a_real_server(bench_server, tiny_llava_dir, tmp_path,
                                                                       protocol):
    url = bench_server.grpc_url if protocol == "triton-grpc" else bench_server.http_url
    baseline = ["--baseline", "hf", "--model", tiny_llava_dir] if protocol == "openai" else []
    rc = main(["serve", "--url", url, "--protocol", protocol, "--device", "cpu", "--request-rates", "20,inf",
               "--concurrency", "2", "--num-requests", "4", "--input-len", "8", "--output-len", "4", "--warmup", "1",
               "--max-duration", "60", "--request-timeout", "60", *baseline, *_outputs(tmp_path)])
    assert rc == 0
    result = _strict_json(tmp_path / "r.json")
    _check_env_and_files(tmp_path, result, "serve", "| point | engine |")
    res = result["results"]
    assert [r["request_rate"] for r in res["rate_sweep"]] == [20.0, "inf"]
    assert [r["concurrency"] for r in res["concurrency_sweep"]] == [2]
    for row in res["rate_sweep"] + res["concurrency_sweep"]:
        m = row["mmserve"]
        assert (m["completed"], m["failed"], m["output_tokens"]) == (4, 0, 16), m["errors"]
        assert all(_positive(m[k]) for k in ("requests_per_s", "output_tok_s", "duration_s"))
        for key in ("ttft_ms", "e2e_ms", "tpot_ms"):
            assert _positive(m[key]["p50"]) and m[key]["p99"] >= m[key]["p50"]
    if protocol == "openai":
        row = res["concurrency_sweep"][0]
        assert row["hf"]["completed"] == 4 and _positive(row["hf"]["ttft_ms"]["p50"])
        assert _positive(row["ratio"]["output_tok_s"])


def test_serve_point_stops_sending_after_max_duration(bench_server, tmp_path):
    rc = main(["serve", "--url", bench_server.http_url, "--protocol", "triton-http", "--device", "cpu",
               "--request-rates", "2", "--concurrency", "", "--num-requests", "50", "--input-len", "4",
               "--output-len", "2", "--warmup", "0", "--max-duration", "1", "--out", str(tmp_path / "r.json")])
    assert rc == 0
    row = _strict_json(tmp_path / "r.json")["results"]["rate_sweep"][0]
    assert row["truncated"] and row["mmserve"]["completed"] + row["mmserve"]["failed"] < 50
