"""`mmserve bench` end to end on CPU with tiny checkpoints (llava, and `--family qwen2_vl` / `blip2` presets):
JSON keys, positive numbers, markdown and plots.

Timings here only have to exist and be positive; their values are never checked (DESIGN §5).
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import pytest
import transformers

from mmserve.bench.cli import main
from mmserve.bench.report import write_outputs
from mmserve.bench.roofline import lm_shape
from mmserve.bench.serve_config import ServeConfig
from mmserve.bench.workload import ModelSource, PromptTemplate, make_prompt
from mmserve.core.outputs import PHASES
from mmserve.models import registry
from mmserve.testing import FAMILIES, family_cases
from tests.conftest import strict_json


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _outputs(tmp_path: Path) -> list[str]:
    return [
        "--out",
        str(tmp_path / "r.json"),
        "--markdown",
        str(tmp_path / "b.md"),
        "--plot-dir",
        str(tmp_path / "plots"),
    ]


def _check_env_and_files(tmp_path: Path, result: dict, bench: str, table_header: str) -> None:
    assert result["schema"] == "mmserve-bench/1" and result["bench"] == bench
    env = result["env"]
    assert (
        env["command"].startswith(f"mmserve bench {bench} ")
        and env["torch"]
        and env["device_name"]
        and env["date"]
    )
    assert result["errors"] == []
    md = (tmp_path / "b.md").read_text()
    assert env["command"] in md and table_header in md
    assert result["plots"] and all(Path(p).stat().st_size > 0 for p in result["plots"])


def test_latency_bench_measures_mmserve_hf_and_roofline_per_batch_size(tiny_llava_dir, tmp_path):
    rc = main(
        [
            "latency",
            "--model",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--batch-sizes",
            "1,2",
            "--input-len",
            "16",
            "--output-len",
            "3",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--baseline",
            "hf",
            *_outputs(tmp_path),
        ]
    )
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    _check_env_and_files(tmp_path, result, "latency", "| batch | TTFT ms mmserve |")
    assert _positive(result["bandwidth"]["gb_per_s"])
    assert result["model"]["text_tokens"] == 16
    assert [r["batch_size"] for r in result["results"]] == [1, 2]
    for row in result["results"]:
        for engine in ("mmserve", "hf"):
            m = row[engine]
            for key in (
                "ttft_ms",
                "ttft_mean_ms",
                "decode_ms_per_step",
                "decode_tok_s",
                "roofline_fraction",
            ):
                assert _positive(m[key]), (engine, key, m[key])
            assert m["prompt_tokens"] > 16  # the image's placeholders come on top of the text
        assert row["mmserve"]["prompt_tokens"] == row["hf"]["prompt_tokens"]
        assert all(
            _positive(row["roofline"][k]) for k in ("bytes_per_step", "ms_per_step", "tok_s")
        )
        assert _positive(row["ratio"]["ttft"]) and _positive(row["ratio"]["decode_tok_s"])


def test_throughput_bench_runs_same_requests_through_llm_generate_and_hf(tiny_llava_dir, tmp_path):
    rc = main(
        [
            "throughput",
            "--model",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--num-requests",
            "3",
            "--input-len",
            "12",
            "--output-len",
            "4",
            "--hf-batch-size",
            "2",
            "--warmup",
            "0",
            *_outputs(tmp_path),
        ]
    )
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    _check_env_and_files(tmp_path, result, "throughput", "| engine | requests |")
    res = result["results"]
    for engine in ("mmserve", "hf"):
        assert res[engine]["num_requests"] == 3 and res[engine]["output_tokens"] == 12
        assert all(
            _positive(res[engine][k]) for k in ("elapsed_s", "requests_per_s", "output_tok_s")
        )
    assert res["mmserve"]["prompt_tokens"] == res["hf"]["prompt_tokens"]
    assert _positive(res["ratio"]["output_tok_s"]) and _positive(res["ratio"]["requests_per_s"])
    # the step breakdown accounts for every computed token: prompts (less cached ones) and each output
    # token but the last, which is sampled and never fed back
    m, steps = res["mmserve"], res["mmserve"]["steps"]
    kinds = {k: v for k, v in steps.items() if k != "idle"}
    assert (
        sum(v["tokens"] for v in kinds.values())
        == m["prompt_tokens"] - m["cached_prompt_tokens"] + 3 * 3
    )
    assert (
        kinds["decode"]["steps"] >= 1 and kinds["decode"]["tokens"] == kinds["decode"]["sequences"]
    )
    wall = sum(v["wall_s"] for v in kinds.values()) + steps["idle"]["host_s"]
    assert 0 < wall <= m["elapsed_s"]
    assert "| step kind | steps |" in (tmp_path / "b.md").read_text()


# ---- other families: --family NAME --preset tiny, the transformers baseline by config.architectures ----


def _family_config(family: str, preset: str) -> Any:
    """The config of ``family``'s ``preset``, from its testing module's ``<family>_config``."""
    module = importlib.import_module(FAMILIES[family].split(":")[0])
    return getattr(module, f"{family}_config")(preset)


def _bench_cases(in_transformers: bool) -> dict[str, tuple[int, str]]:
    """family -> (--input-len, its tiny preset's architecture) of the families whose FamilyCase declares a
    bench_input_len, those transformers has a class of (``in_transformers``) or the others."""
    cases = {
        family: (case.bench_input_len, _family_config(family, "tiny").architectures[0])
        for family, case in family_cases().items()
        if case.bench_input_len is not None
    }
    return {f: c for f, c in cases.items() if hasattr(transformers, c[1]) == in_transformers}


FAMILY_CASES = _bench_cases(in_transformers=True)


@pytest.fixture(scope="module")
def family_work_dir(tmp_path_factory) -> str:
    """One --work-dir for the module, so each family's tiny preset is written once for both benches."""
    return str(tmp_path_factory.mktemp("bench-families"))


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_latency_bench_runs_a_family_preset_against_its_transformers_class(
    family, family_work_dir, tmp_path
):
    input_len, arch = FAMILY_CASES[family]
    rc = main(
        [
            "latency",
            "--family",
            family,
            "--preset",
            "tiny",
            "--work-dir",
            family_work_dir,
            "--device",
            "cpu",
            "--batch-sizes",
            "1",
            "--input-len",
            str(input_len),
            "--output-len",
            "2",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--baseline",
            "hf",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["errors"] == []
    model = result["model"]
    spec = registry.family_named(family)
    assert (model["family"], model["preset"], model["architecture"]) == (family, "tiny", arch)
    assert arch in spec.architectures
    assert Path(model["path"]).name == f"{family}-tiny" and model["text_tokens"] == input_len
    assert [r["batch_size"] for r in result["results"]] == [
        1
    ]  # batches of 2: the throughput test below
    for row in result["results"]:
        for engine in ("mmserve", "hf"):
            assert all(
                _positive(row[engine][k]) for k in ("ttft_ms", "decode_ms_per_step", "decode_tok_s")
            )
        assert row["mmserve"]["prompt_tokens"] == row["hf"]["prompt_tokens"]
        # + the image's tokens, but for an encoder-decoder, whose prompt is its decoder's (the start token alone
        # where its encoder reads the text: Deplot's question is drawn on the picture)
        want = (1 if spec.encoder_reads_text else input_len) if spec.encoder_decoder else None
        assert (
            row["mmserve"]["prompt_tokens"] == want
            if want
            else row["mmserve"]["prompt_tokens"] > input_len
        )
        assert _positive(row["roofline"]["ms_per_step"])


# the families transformers has no class of: no baseline, the roofline from the family's own config
NO_HF_FAMILIES = _bench_cases(in_transformers=False)


@pytest.mark.parametrize("family", sorted(NO_HF_FAMILIES))
def test_latency_bench_runs_the_families_without_a_transformers_class(
    family, family_work_dir, tmp_path
):
    input_len, arch = NO_HF_FAMILIES[family]
    args = ["latency", "--family", family, "--preset", "tiny", "--work-dir", family_work_dir]
    args += ["--device", "cpu", "--batch-sizes", "1", "--input-len", str(input_len)]
    args += ["--output-len", "2", "--warmup", "0", "--iters", "1", "--baseline", "none"]
    args += ["--out", str(tmp_path / "r.json")]
    assert main(args) == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["errors"] == [] and result["model"]["architecture"] == arch
    assert arch in registry.family_named(family).architectures
    (row,) = result["results"]
    assert not row.get("hf")  # no baseline to run
    assert _positive(row["mmserve"]["decode_tok_s"]) and _positive(row["roofline"]["ms_per_step"])


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_throughput_bench_runs_a_family_preset_against_its_transformers_class(
    family, family_work_dir, tmp_path
):
    input_len, _ = FAMILY_CASES[family]
    rc = main(
        [
            "throughput",
            "--family",
            family,
            "--preset",
            "tiny",
            "--work-dir",
            family_work_dir,
            "--device",
            "cpu",
            "--num-requests",
            "2",
            "--input-len",
            str(input_len),
            "--output-len",
            "4",
            "--hf-batch-size",
            "2",
            "--warmup",
            "0",
            "--baseline",
            "hf",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["errors"] == [] and result["model"]["family"] == family
    res = result["results"]
    for engine in ("mmserve", "hf"):
        assert res[engine]["num_requests"] == 2 and res[engine]["output_tokens"] == 8
        assert _positive(res[engine]["output_tok_s"])
    assert res["mmserve"]["prompt_tokens"] == res["hf"]["prompt_tokens"]


def test_unknown_preset_or_family_is_refused_naming_the_known_ones(capsys):
    assert (
        main(["latency", "--family", "qwen2_vl", "--preset", "llava-1.5-7b", "--device", "cpu"])
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "unknown qwen2_vl preset 'llava-1.5-7b'" in err
        and "qwen2-vl-7b" in err
        and "qwen2.5-vl-7b" in err
    )
    assert main(["throughput", "--family", "gpt2", "--preset", "tiny", "--device", "cpu"]) == 2
    assert "unknown model family 'gpt2'" in capsys.readouterr().err
    assert main(["latency", "--family", "blip2", "--model", "/nonexistent", "--device", "cpu"]) == 2
    assert "--family goes with --preset" in capsys.readouterr().err
    with pytest.raises(ValueError, match="blip2 presets: tiny, blip2-opt-2.7b"):
        ModelSource(family="blip2", preset="large")


def test_prompts_follow_each_checkpoint_s_own_template(family_work_dir):
    qwen = PromptTemplate(
        ModelSource(family="qwen2_vl", preset="tiny", work_dir=family_work_dir).resolve()
    )
    spec = make_prompt(qwen, 60)
    assert spec.text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    assert spec.text.endswith("<|im_start|>assistant\n") and spec.text_tokens == 60
    blip2 = PromptTemplate(
        ModelSource(family="blip2", preset="tiny", work_dir=family_work_dir).resolve()
    )
    spec = make_prompt(blip2, 24)
    assert (
        spec.text.startswith("Question: ")
        and spec.text.endswith(" Answer:")
        and "<image>" not in spec.text
    )
    assert spec.text_tokens == len(blip2.tokenizer(spec.text).input_ids) == 24


def test_preset_checkpoint_is_written_once_then_reused(tmp_path):
    source = ModelSource(preset="tiny", work_dir=str(tmp_path))
    first = Path(source.resolve())
    assert first.name == "llava-tiny" and source.family == "llava"
    stamp = (first / "config.json").stat().st_mtime_ns
    assert Path(source.resolve()) == first and (first / "config.json").stat().st_mtime_ns == stamp
    assert not Path(f"{first}.partial").exists()


def test_prompt_has_exactly_the_asked_text_tokens(tiny_llava_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llava_dir)
    template = PromptTemplate(tiny_llava_dir)
    for n in (16, 40, 128):
        spec = make_prompt(template, n)
        assert spec.text_tokens == n and spec.text.count("<image>") == 1
        assert (
            spec.text == f"USER: <image>\n{spec.filler} ASSISTANT:"
        )  # llava-1.5's own chat template
        assert len(tok(spec.text).input_ids) - 1 == n


def _all_presets() -> list[tuple[str, str]]:
    """(family, preset) of every family transformers has a class of; the others' roofline is checked in their own
    checkpoint tests, against the transformers model of their text part (e.g. tests/unit/test_vila_checkpoint.py)."""
    from mmserve.bench.workload import family_presets

    def in_transformers(family: str) -> bool:
        config = _family_config(family, family_presets(family)[0])
        return hasattr(transformers, config.architectures[0])

    return [(f, p) for f in FAMILIES if in_transformers(f) for p in family_presets(f)]


def _lm_bytes(model, dtype_bytes: int, vlm: bool) -> int:
    """Bytes of the language model's parameters (a vision-encoder-decoder's: its decoder's; an encoder-decoder text
    model's (T5): its decoder's and lm_head) but its embedding tables (a tied lm_head counts once more; T5's relative
    position bias tables) and the cross-attention k/v projections of Mllama, MBart, T5 and Pix2Struct (run once per image or
    request, not per decode step)."""
    lm_prefixes = ("lm_head", "text_model.", "decoder.")
    return dtype_bytes * sum(
        p.numel()
        for n, p in model.named_parameters(remove_duplicate=False)
        if (not vlm or "language_model" in n or n.startswith(lm_prefixes))
        and "embed_tokens" not in n
        and "embed_positions" not in n
        and "cross_attn.k_proj" not in n
        and "cross_attn.v_proj" not in n
        and "encoder_attn.k_proj" not in n
        and "encoder_attn.v_proj" not in n
        and not n.startswith(("language_model.encoder.", "language_model.shared."))
        and "EncDecAttention.k." not in n
        and "EncDecAttention.v." not in n
        and "encoder_decoder_attention.attention.key" not in n
        and "encoder_decoder_attention.attention.value" not in n
        and "relative_attention_bias" not in n
    )


@pytest.mark.parametrize(("family", "preset"), _all_presets())
def test_roofline_weight_bytes_match_the_transformers_language_model(family, preset, tmp_path):
    import torch

    config = _family_config(family, preset)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):  # shapes only: the 7B presets cost no memory
        model = getattr(transformers, config.architectures[0])(config)
    for dtype, nbytes in (("float32", 4), ("float16", 2)):
        assert lm_shape(str(tmp_path), dtype).weight_bytes == _lm_bytes(model, nbytes, vlm=True), (
            dtype
        )


def test_roofline_counts_quantized_decoder_matrices_at_their_stored_bytes(tiny_llava_dir):
    """FP8 and int8 matrices: one byte per element; int4: half a byte (the roofline of `--quantization`)."""
    from mmserve import LLM
    from mmserve.models.quantization import decoder_linears

    llm = LLM(tiny_llava_dir, device="cpu", dtype="float32", quantization="fp8")
    elements = sum(m.weight.numel() for _, m in decoder_linears(llm.engine.model))
    plain, fp8, int8, int4 = (
        lm_shape(tiny_llava_dir, "float32", quantization=q).weight_bytes
        for q in (None, "fp8", "int8", "int4")
    )
    assert plain - fp8 == plain - int8 == elements * (4 - 1)
    assert plain - int4 == elements * (4 - 0.5)


def test_latency_bench_with_two_shards_reports_them_and_a_per_gpu_roofline(
    tiny_llava_dir, tmp_path
):
    rc = main(
        [
            "latency",
            "--model",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--batch-sizes",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--warmup",
            "0",
            "--iters",
            "1",
            "--baseline",
            "none",
            "--tensor-parallel-size",
            "2",
            "--enforce-eager",
            *_outputs(tmp_path),
        ]
    )
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["errors"] == [] and result["config"]["tensor_parallel_size"] == 2
    assert _positive(result["results"][0]["mmserve"]["decode_tok_s"])
    md = (tmp_path / "b.md").read_text()
    assert "language model over 2 GPUs (tensor parallel" in md and "without CUDA graphs" in md
    # each GPU reads half of the decoder's matrices and KV heads; norms, embeddings and the LM head whole
    one, two = (lm_shape(tiny_llava_dir, "float32", tp=t) for t in (1, 2))
    q, kv = one.heads * one.head_dim, one.kv_heads * one.head_dim
    elements = one.layers * (
        2 * one.hidden * q + 2 * one.hidden * kv + 3 * one.hidden * one.intermediate
    )
    assert one.weight_bytes - two.weight_bytes == elements * one.dtype_bytes // 2
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token


@pytest.mark.parametrize(
    "variant",
    [
        {"do_layer_norm_before": False},  # post-LN, no final norm
        {"word_embed_proj_dim": 24, "tie_word_embeddings": False},
    ],
)  # project_in/out
def test_roofline_weight_bytes_of_opt_variants(variant, tmp_path):
    import torch
    import transformers

    config = transformers.OPTConfig(
        vocab_size=96,
        hidden_size=36,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=52,
        max_position_embeddings=64,
        **variant,
    )
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.OPTForCausalLM(config)
    assert lm_shape(str(tmp_path), "float32").weight_bytes == _lm_bytes(model, 4, vlm=False)


def test_markdown_file_gets_each_run_appended(tmp_path):
    result = {
        "bench": "throughput",
        "schema": "mmserve-bench/1",
        "errors": [],
        "env": {"date": "d", "command": "mmserve bench throughput x", "device": "cpu"},
        "model": {"preset": "tiny", "dtype": "float32", "text_tokens": 4},
        "config": {
            "num_requests": 1,
            "output_len": 2,
            "max_num_seqs": 1,
            "hf_batch_size": 1,
            "rate": math.inf,
        },
        "results": {
            "mmserve": {
                "num_requests": 1,
                "elapsed_s": 1.0,
                "requests_per_s": 1.0,
                "output_tok_s": 2.0,
                "total_tok_s": 6.0,
            }
        },
    }
    md_path, out = tmp_path / "b.md", tmp_path / "r.json"
    write_outputs(result, str(out), str(md_path), None)
    write_outputs(result, str(out), str(md_path), None)
    assert md_path.read_text().count("### `mmserve bench throughput`") == 2
    assert strict_json(out.read_text())["config"]["rate"] == "inf"


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
    from tests.server.conftest import start_server

    with start_server(tiny_llava_dir, tmp_path_factory.mktemp("bench-server-logs")) as handle:
        yield handle


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc", "openai"])
def test_serve_bench_sweeps_rate_and_concurrency_against_a_real_server(
    bench_server, tiny_llava_dir, tmp_path, protocol
):
    url = bench_server.grpc_url if protocol == "triton-grpc" else bench_server.http_url
    baseline = ["--baseline", "hf", "--model", tiny_llava_dir] if protocol == "openai" else []
    rc = main(
        [
            "serve",
            "--url",
            url,
            "--protocol",
            protocol,
            "--device",
            "cpu",
            "--request-rates",
            "20,inf",
            "--concurrency",
            "2",
            "--num-requests",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--warmup",
            "1",
            "--max-duration",
            "60",
            "--request-timeout",
            "60",
            *baseline,
            *_outputs(tmp_path),
        ]
    )
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    _check_env_and_files(tmp_path, result, "serve", "| point | engine |")
    res = result["results"]
    assert [r["request_rate"] for r in res["rate_sweep"]] == [20.0, "inf"]
    assert [r["concurrency"] for r in res["concurrency_sweep"]] == [2]
    assert result["labels"] == {"server": "mmserve", "hf": "transformers"}  # the server's own name
    for row in res["rate_sweep"] + res["concurrency_sweep"]:
        m = row["server"]
        assert (m["completed"], m["failed"], m["output_tokens"]) == (4, 0, 16), m["errors"]
        assert all(_positive(m[k]) for k in ("requests_per_s", "output_tok_s", "duration_s"))
        for key in ("ttft_ms", "e2e_ms", "tpot_ms"):
            assert _positive(m[key]["p50"]) and m[key]["p99"] >= m[key]["p50"]
        if (
            protocol == "triton-grpc"
        ):  # the server's /metrics is on its HTTP port, which the bench is not told
            assert row["phases"] is None
        else:  # each point's own requests, from the server's phase histogram scraped around the point
            means = row["phases"]["mean_ms"]
            assert list(means) == list(PHASES) and all(
                v is not None and v >= 0 for v in means.values()
            )
            assert sum(means.values()) <= m["ttft_ms"]["max"] + 1.0
    report = (tmp_path / "b.md").read_text()
    assert ("Where the first token's time goes" in report) == (protocol != "triton-grpc")
    if protocol == "openai":
        row = res["concurrency_sweep"][0]
        assert row["hf"]["completed"] == 4 and _positive(row["hf"]["ttft_ms"]["p50"])
        assert _positive(row["ratio"]["output_tok_s"])


def test_the_cli_imports_no_server_package():
    """`mmserve bench` runs on GPU machines that have torch and transformers but no server packages: importing the
    CLI (which parses `serve`'s options, restricted API groups included) must not import grpc, fastapi, uvicorn or
    tritonclient."""
    import subprocess
    import sys

    code = (
        "import sys, mmserve.entrypoints.cli, mmserve.entrypoints.server_config; "
        "print([m for m in ('grpc', 'fastapi', 'uvicorn', 'tritonclient') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_serve_point_stops_sending_after_max_duration(bench_server, tmp_path):
    rc = main(
        [
            "serve",
            "--url",
            bench_server.http_url,
            "--protocol",
            "triton-http",
            "--device",
            "cpu",
            "--request-rates",
            "2",
            "--concurrency",
            "",
            "--num-requests",
            "50",
            "--input-len",
            "4",
            "--output-len",
            "2",
            "--warmup",
            "0",
            "--max-duration",
            "1",
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    row = strict_json((tmp_path / "r.json").read_text())["results"]["rate_sweep"][0]
    assert row["truncated"] and row["server"]["completed"] + row["server"]["failed"] < 50


def test_throughput_bench_can_sample_in_both_engines(tiny_llava_dir, tmp_path, capsys):
    """--temperature / --top-p / --top-k reach mmserve's SamplingParams and transformers' generate (top_k 0 is
    off there too, not its default 50); the record and the markdown say how the tokens were drawn."""
    rc = main(
        [
            "throughput",
            "--model",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--num-requests",
            "3",
            "--input-len",
            "12",
            "--output-len",
            "4",
            "--hf-batch-size",
            "2",
            "--warmup",
            "0",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            *_outputs(tmp_path),
        ]
    )
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["errors"] == []
    assert (
        result["config"]["temperature"],
        result["config"]["top_p"],
        result["config"]["top_k"],
    ) == (0.8, 0.9, 5)
    for engine in ("mmserve", "hf"):
        assert result["results"][engine]["output_tokens"] == 12
    assert "sampled at temperature 0.8, top-p 0.9, top-k 5" in (tmp_path / "b.md").read_text()
    capsys.readouterr()
    assert main(["throughput", "--model", tiny_llava_dir, "--device", "cpu", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_throughput_bench_same_image_shares_the_image_not_the_text(tiny_llava_dir, tmp_path):
    rc = main(
        [
            "throughput",
            "--model",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--num-requests",
            "4",
            "--input-len",
            "40",
            "--output-len",
            "2",
            "--hf-batch-size",
            "2",
            "--warmup",
            "0",
            "--same-image",
            "--max-num-seqs",
            "1",
            *_outputs(tmp_path),
        ]
    )  # one at a time: each finds the last one's blocks
    assert rc == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["config"]["same_image"] is True
    assert result["model"]["distinct_texts"] == 4 and result["model"]["text_tokens"] == 40
    res = result["results"]
    assert res["mmserve"]["prompt_tokens"] == res["hf"]["prompt_tokens"]
    assert (
        res["mmserve"]["cached_prompt_tokens"] > 0
    )  # the image's blocks came from the prefix cache
    assert "one image shared by all requests, 4 distinct texts" in (tmp_path / "b.md").read_text()
    # distinct images (the default): nothing to reuse, not even in a second timed round
    rc = main(
        [
            "throughput",
            "--model",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--num-requests",
            "3",
            "--input-len",
            "12",
            "--output-len",
            "2",
            "--baseline",
            "none",
            "--warmup",
            "0",
            "--iters",
            "2",
            "--out",
            str(tmp_path / "d.json"),
            "--markdown",
            str(tmp_path / "d.md"),
        ]
    )
    mm = strict_json((tmp_path / "d.json").read_text())["results"]["mmserve"]
    assert rc == 0 and mm["cached_prompt_tokens"] == 0
    # every timed round is kept; the reported one is the best of them
    assert len(mm["output_tok_s_every_round"]) == 2 and mm["output_tok_s"] == max(
        mm["output_tok_s_every_round"]
    )
    assert "in each of its 2 timed rounds" in (tmp_path / "d.md").read_text()


def test_throughput_rounds_draw_new_images():
    from mmserve.bench.throughput import ThroughputConfig, _image_rounds
    from mmserve.bench.workload import ModelSource
    from mmserve.multimodal.hashing import hash_image

    for same_image in (False, True):
        cfg = ThroughputConfig(
            source=ModelSource(preset="tiny"),
            device="cpu",
            dtype="float32",
            num_requests=3,
            iters=2,
            same_image=same_image,
        )
        rounds = [[hash_image(im) for im in images] for images in _image_rounds(cfg, 16)]
        assert len(rounds) == 2 and all(len(r) == 3 for r in rounds)
        assert not set(rounds[0]) & set(rounds[1])  # no picture of round 1 again in round 2
        assert len(set(rounds[0])) == (1 if same_image else 3)


def test_latency_bench_reports_memory_and_quantized_weights_are_smaller(tiny_llava_dir, tmp_path):
    """The weights as stored: int8 decoder matrices take a quarter of their float32 bytes, the rest stays."""
    memory, reports = {}, {}
    for q in ("none", "int8"):
        out = tmp_path / q
        flags = [] if q == "none" else ["--quantization", q]
        args = ["latency", "--model", tiny_llava_dir, "--device", "cpu", "--dtype", "float32"]
        args += ["--batch-sizes", "1", "--input-len", "8", "--output-len", "2", "--iters", "1"]
        args += [
            "--baseline",
            "none",
            "--out",
            str(out / "r.json"),
            "--markdown",
            str(out / "r.md"),
        ]
        assert main(args + flags) == 0
        memory[q] = strict_json((out / "r.json").read_text())["memory"]
        reports[q] = (out / "r.md").read_text()
    full, int8 = memory["none"], memory["int8"]
    assert full["peak_allocated_gib"] is None and _positive(
        full["kv_cache_gib"]
    )  # no peak on the CPU
    assert 0 < int8["weights_gib"] < full["weights_gib"]
    shape = lm_shape(tiny_llava_dir, "float32")
    saved = (
        shape.weight_bytes - lm_shape(tiny_llava_dir, "float32", quantization="int8").weight_bytes
    )
    # the int8 run also stores per-channel scales, a few bytes per output row
    assert full["weights_gib"] - int8["weights_gib"] == pytest.approx(saved / 2**30, rel=0.05)
    assert "weights" in reports["int8"] and "GiB as stored" in reports["int8"]


def test_bench_quantization_choices_are_the_servers():
    """The bench parser lists `--quantization`'s methods itself (it imports no torch); they are config's."""
    from mmserve.bench.cli import build_parser
    from mmserve.config import QUANTIZATION_METHODS

    args = build_parser().parse_args(["latency", "--quantization", QUANTIZATION_METHODS[-1]])
    assert args.quantization == QUANTIZATION_METHODS[-1]
    (action,) = [
        a
        for a in build_parser()._subparsers._group_actions[0].choices["latency"]._actions
        if a.dest == "quantization"
    ]
    assert tuple(action.choices) == QUANTIZATION_METHODS
