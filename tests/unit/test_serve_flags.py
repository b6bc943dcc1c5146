"""`mmserve serve`'s flags, parsed in process: generated from the configuration dataclasses with their help and
defaults in groups; every flag also from MMSERVE_<FLAG> and a --config YAML file (command line > environment >
file > defaults); vLLM's aliases; bad environment and file values stop with one line and status 2."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mmserve.entrypoints.serve_args import (
    GROUPS,
    build_engine_config,
    build_media_config,
    build_server_config,
    explain,
    parse_serve_args,
    serve_flags,
    serve_parser,
)

# every flag `serve` had before the flags were generated: its dest and default, which must not change
OLD_DEFAULTS = {
    "model": None,
    "host": "127.0.0.1",
    "http_port": 8000,
    "grpc_port": 8001,
    "served_model_name": None,
    "dtype": "auto",
    "device": "auto",
    "max_num_seqs": 64,
    "max_model_len": None,
    "max_num_batched_tokens": 2048,
    "block_size": 16,
    "kv_cache_memory_fraction": 0.9,
    "cross_kv_cache_fraction": 0.5,
    "kv_cache_size_gb": 1.0,
    "num_kv_blocks": None,
    "kv_cache_dtype": "auto",
    "quantization": None,
    "no_prefix_caching": False,
    "prompt_end_cache_size": 1024,
    "encoder_cache_size": 16384,
    "no_chunked_prefill": False,
    "no_async_scheduling": False,
    "revision": None,
    "download_dir": None,
    "api_key": None,
    "allowed_origins": [],
    "max_concurrent_requests": 1024,
    "exit_timeout_secs": 30.0,
    "max_waiting": 4096,
    "max_request_bytes": 64 * 2**20,
    "max_stop_sequences": 64,
    "max_stop_sequence_chars": 4096,
    "allow_private_media_urls": False,
    "allowed_local_media_path": None,
    "max_images_per_request": 16,
    "max_media_bytes": 32 * 2**20,
    "max_image_pixels": 64 * 2**20,
    "max_image_aspect_ratio": 200.0,
    "max_video_frames": 64,
    "media_fetch_timeout": 10.0,
    "header_font": None,
    "accumulate_tokens": False,
    "http_restricted_api": [],
    "ssl_certfile": None,
    "ssl_keyfile": None,
    "grpc_use_ssl": False,
    "grpc_use_ssl_mutual": False,
    "grpc_server_cert": None,
    "grpc_server_key": None,
    "grpc_root_cert": None,
    "grpc_restricted_protocol": [],
    "attention_backend": "auto",
    "enforce_eager": False,
    "cpu_preprocess": False,
    "seed": 0,
    "lora_modules": [],
    "max_loras": 8,
    "tensor_parallel_size": 1,
    "log_level": "info",
}


def parse(*argv: str, **env: str) -> argparse.Namespace:
    return parse_serve_args(list(argv), env)


def test_the_old_flags_keep_their_defaults_and_types():
    args = parse()
    for dest, default in OLD_DEFAULTS.items():
        value = getattr(args, dest)
        assert value == default and type(value) is type(default), (dest, value)
    args = parse(
        "m", "--max-num-seqs", "3", "--kv-cache-memory-fraction", "0.5", "--no-prefix-caching"
    )
    assert (args.model, args.max_num_seqs, args.kv_cache_memory_fraction) == ("m", 3, 0.5)
    assert build_engine_config(args).cache.enable_prefix_caching is False
    assert build_engine_config(parse("m")).cache.enable_prefix_caching is True


def test_help_shows_every_flag_with_its_default_in_groups():
    text = serve_parser().format_help()
    titles = [line[:-1] for line in text.splitlines() if line[:-1] in GROUPS and line.endswith(":")]
    assert titles == list(GROUPS)  # model, cache, scheduler, server, media, security, parallel
    for flag in serve_flags():
        assert flag.help and flag.option in text
    flat = " ".join(text.split())
    assert "--max-num-seqs MAX_NUM_SEQS requests running at once" in flat
    assert (
        "(default: 64)" in flat and "(default: 32 MiB)" in flat and "(default: 127.0.0.1)" in flat
    )
    assert (
        "--no-prefix-caching reuse the KV blocks" in flat and "turns it off (default: on)" in flat
    )
    for action in serve_parser()._actions:
        if action.dest not in ("help", "config"):
            assert action.help and "(default: " in action.help, action.dest


def test_each_flag_is_an_environment_variable(tmp_path):
    args = parse(
        MMSERVE_MAX_NUM_SEQS="5",
        MMSERVE_KV_CACHE_MEMORY_FRACTION="0.25",
        MMSERVE_SERVED_MODEL_NAME="env-name",
        MMSERVE_ENFORCE_EAGER="true",
        MMSERVE_NO_PREFIX_CACHING="1",
        MMSERVE_SKIP_SPECIAL_TOKENS="false",
        MMSERVE_ALLOWED_ORIGINS="https://a.example https://b.example",
        MMSERVE_HTTP_RESTRICTED_API="'inference,metadata:x=a b' health:y=z",
        MMSERVE_MODEL=str(tmp_path),
        MMSERVE_MAX_MODEL_LEN="",  # empty: not set
    )
    assert (args.max_num_seqs, args.kv_cache_memory_fraction, args.served_model_name) == (
        5,
        0.25,
        "env-name",
    )
    assert args.enforce_eager and args.no_prefix_caching and args.skip_special_tokens is False
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    assert args.http_restricted_api == ["inference,metadata:x=a b", "health:y=z"]
    assert args.model == str(tmp_path) and args.max_model_len is None
    assert args.sources["max_num_seqs"] == "MMSERVE_MAX_NUM_SEQS"
    server = build_server_config(args)
    assert server.allowed_origins == ("https://a.example", "https://b.example")
    assert server.max_batch_size == 5 and server.skip_special_tokens is False


def test_api_key_still_reads_its_variable_and_help_never_shows_it():
    assert parse(MMSERVE_API_KEY="zebra").api_key == "zebra"
    assert parse("--api-key", "k", MMSERVE_API_KEY="zebra").api_key == "k"
    assert "zebra" not in serve_parser().format_help()


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_a_yaml_file_with_dashes_underscores_and_aliases(tmp_path):
    path = _yaml(
        tmp_path,
        "max-num-seqs: 7\nmax_waiting: 100\nport: 9100\ntp-size: 1\nno-chunked-prefill: true\n"
        "exclude_input_in_output: yes\nhttp-restricted-api: ['inference:a=b']\n"
        "media_fetch_timeout: 2\nmodel: /ckpt\n",
    )
    args = parse("--config", path)
    assert (args.max_num_seqs, args.max_waiting, args.http_port, args.media_fetch_timeout) == (
        7,
        100,
        9100,
        2.0,
    )
    assert args.no_chunked_prefill and args.exclude_input_in_output and args.model == "/ckpt"
    assert args.http_restricted_api == ["inference:a=b"]
    assert args.sources["http_port"] == f"{path}: port"
    assert parse(MMSERVE_CONFIG=path).max_num_seqs == 7


def test_command_line_over_environment_over_file_over_defaults(tmp_path):
    path = _yaml(
        tmp_path,
        "max-num-seqs: 7\nmax-waiting: 100\nblock-size: 32\nhttp-restricted-api: ['inference:a=b']\n",
    )
    env = dict(MMSERVE_MAX_NUM_SEQS="5", MMSERVE_MAX_WAITING="50", MMSERVE_CONFIG=path)
    args = parse("--max-num-seqs", "3", "--http-restricted-api", "health:c=d", **env)
    assert (args.max_num_seqs, args.max_waiting, args.block_size, args.max_loras) == (3, 50, 32, 8)
    assert args.http_restricted_api == ["health:c=d"]  # replaced, not added to
    assert parse("--config", path, MMSERVE_MAX_WAITING="50").max_waiting == 50


def test_vllm_aliases():
    args = parse(
        "--port", "9000", "--tp-size", "1", "--served-model-name", "x", "--max-model-len", "99"
    )
    assert (args.http_port, args.tensor_parallel_size) == (9000, 1)
    assert (args.served_model_name, args.max_model_len) == ("x", 99)
    # an alias is no variable: Kubernetes sets MMSERVE_PORT=tcp://... for a Service named mmserve
    assert parse(MMSERVE_PORT="tcp://10.0.0.1:8000").http_port == 8000
    assert not any(f.option == "--gpu-memory-utilization" for f in serve_flags())


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MMSERVE_MAX_NUM_SEQS": "x"}, "MMSERVE_MAX_NUM_SEQS: invalid int value 'x'"),
        (
            {"MMSERVE_KV_CACHE_SIZE_GB": "big"},
            "MMSERVE_KV_CACHE_SIZE_GB: invalid float value 'big'",
        ),
        (
            {"MMSERVE_ENFORCE_EAGER": "maybe"},
            "MMSERVE_ENFORCE_EAGER: invalid boolean value 'maybe'",
        ),
        ({"MMSERVE_KV_CACHE_DTYPE": "int4"}, "MMSERVE_KV_CACHE_DTYPE: invalid choice 'int4'"),
        ({"MMSERVE_CONFIG": "/nowhere.yaml"}, "MMSERVE_CONFIG /nowhere.yaml: cannot read it"),
    ],
)
def test_a_bad_environment_value_stops_with_one_line(env, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args([], env)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("mmserve serve: ")
    assert message in err, err


@pytest.mark.parametrize(
    "text, message",
    [
        ("max-num-seqs: many\n", r"serve.yaml: max-num-seqs: invalid int value 'many'"),
        ("max_num_seqs: 2.5\n", r"serve.yaml: max_num_seqs: invalid int value 2.5"),
        ("no-such-flag: 1\n", r"serve.yaml: unknown key 'no-such-flag'"),
        ("port: 1\nhttp-port: 2\n", r"serve.yaml: http-port sets the same flag as .*: port"),
        ("max-num-seqs: [1\n", r"--config .*serve.yaml: not valid YAML at line 2"),
        ("- 1\n", r"expected a mapping of flag names to values"),
    ],
)
def test_a_bad_file_value_stops_with_one_line(text, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args(["--config", _yaml(tmp_path, text)], {})
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and re.search(message, err), err


def test_a_bad_setting_names_where_it_came_from(tmp_path):
    args = parse("m", MMSERVE_MAX_NUM_SEQS="0")
    with pytest.raises(ValueError) as err:
        build_engine_config(args)
    assert explain(err.value, args) == "MMSERVE_MAX_NUM_SEQS: max_num_seqs must be >= 1, got 0"
    args = parse("--config", _yaml(tmp_path, "max-image-aspect-ratio: 0.5\n"))
    with pytest.raises(ValueError) as err:
        build_media_config(args)
    assert explain(err.value, args).startswith(f"{tmp_path / 'serve.yaml'}: max-image-aspect-ratio")
    args = parse("--exit-timeout-secs", "-1")
    with pytest.raises(ValueError) as err:
        build_server_config(args)
    assert explain(err.value, args).startswith("--exit-timeout-secs: exit_timeout_secs must be")


def test_docs_list_every_flag():
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    missing = [f.option for f in serve_flags() if f"`{f.option}" not in text]
    assert not missing, missing


def test_serve_takes_every_quantization_method():
    """`serve --quantization` offers config's methods (the new ones included), and nothing else."""
    from mmserve.config import QUANTIZATION_METHODS
    from mmserve.entrypoints.serve_args import parse_serve_args

    for method in QUANTIZATION_METHODS:
        assert parse_serve_args(["m", "--quantization", method], {}).quantization == method
    with pytest.raises(SystemExit):
        parse_serve_args(
            ["m", "--quantization", "awq"], {}
        )  # a checkpoint's format, not a conversion
