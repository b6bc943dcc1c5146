"""The flags of `mmserve serve`, generated from the configuration dataclasses they set (entrypoints/
config_flags.py): ModelConfig, CacheConfig, SchedulerConfig, RequestLimits (the engine's, `build_engine_config`),
MediaConfig (`build_media_config`), ServerConfig (`build_server_config`) and LaunchOptions (what `serve` itself
reads). Each flag is also `MMSERVE_<FLAG>` and a key of `--config FILE.yaml`. The builders raise ValueError for a
bad value; `explain` names where it came from."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mmserve.config import (
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from mmserve.entrypoints.config_flags import (
    ConfigError,
    Flag,
    add_flags,
    flags_of,
    name_source,
    resolve,
)
from mmserve.entrypoints.server_config import ServerConfig
from mmserve.multimodal.media_limits import MediaConfig
from mmserve.sampling_params import RequestLimits

ENV_PREFIX = "MMSERVE_"
GROUPS = {
    "model": "which checkpoint, how it is fetched and run",
    "cache": "the paged KV cache and the other caches",
    "scheduler": "continuous batching",
    "server": "the HTTP and gRPC frontends, their limits and the Triton models' settings",
    "media": "limits on the pictures and videos requests send",
    "security": "who may call the server, over what, and which media it may read",
    "parallel": "more than one GPU",
}
EPILOG = (
    "Every flag can also be set by the environment variable MMSERVE_<FLAG> (upper case, dashes as "
    "underscores: MMSERVE_MAX_NUM_SEQS=128; booleans true / false; lists as shell words) or in the YAML file "
    "of --config (keys: flag names, with dashes or underscores). The command line wins over the environment, "
    "the environment over the file. Aliases (--port, --tp-size) are for the command line and the file only."
)


@dataclass
class LaunchOptions:
    """What `mmserve serve` reads itself: the model to serve and how to fetch it, adapters, logging."""

    model: str | None = field(
        default=None,
        metadata=dict(
            help="a Hugging Face checkpoint directory or hub model ID; none: the embedded demo LLaVA"
        ),
    )
    revision: str | None = field(
        default=None,
        metadata=dict(help="with a hub model ID: the branch, tag or commit to serve; none: main"),
    )
    download_dir: str | None = field(
        default=None,
        metadata=dict(
            help="with a hub model ID: the cache to download into and read from; none: the hub cache "
            "(HF_HUB_CACHE / HF_HOME). HF_HUB_OFFLINE=1 reads the cache only, HF_TOKEN opens gated "
            "repos"
        ),
    )
    lora_modules: list[str] = field(
        default_factory=list,
        metadata=dict(help="PEFT LoRA adapters to load; OpenAI requests name one as their `model`"),
    )
    data_parallel_size: int = field(
        default=1,
        metadata=dict(
            help="engine replicas, each on its own GPU (or tensor-parallel group), as a Ray Serve application "
            "behind Ray's HTTP proxy on --http-port; > 1 (or --ray-address) serves through Ray "
            '(pip install mmserve[ray]; docs/deploy.md "Replicas on Ray Serve")'
        ),
    )
    ray_address: str | None = field(
        default=None,
        metadata=dict(
            help="the Ray cluster to deploy the replicas on, HOST:PORT of its head (`ray start --head`); none: "
            "a local Ray started for this server"
        ),
    )
    ray_autoscaling_config: str | None = field(
        default=None,
        metadata=dict(
            help='Ray Serve\'s autoscaling_config as JSON, e.g. \'{"min_replicas": 1, "max_replicas": 4, '
            '"target_ongoing_requests": 8}\': replicas follow the queue depth instead of '
            "--data-parallel-size"
        ),
    )
    log_level: str = field(
        default="info", metadata=dict(help="debug | info | warning | error | critical")
    )
    log_format: str = field(
        default="text",
        metadata=dict(
            help="text, or json: one object per line (time, level, logger, message, a request's fields), "
            "for every log line of the server"
        ),
    )


_LIMITS_HELP = {  # RequestLimits (sampling_params.py) documents its fields in its docstring
    "max_stop_sequences": dict(
        help="entries of each stop / bad-word list of a request: stop strings, stop_token_ids, "
        "stop_words, bad_words, stop_words_list, bad_words_list"
    ),
    "max_stop_sequence_chars": dict(
        help="characters (strings) or token ids (token lists) in all of each such list"
    ),
}


@functools.cache
def serve_flags() -> tuple[Flag, ...]:
    """Every flag of `mmserve serve`, in help order."""
    restricted = dict(append=True, metavar="APIS:KEY=VALUE", group="security")
    return (
        *flags_of(
            LaunchOptions,
            "model",
            model=dict(option="model"),
            lora_modules=dict(metavar="NAME=PATH"),
            log_level=dict(group="server"),
            log_format=dict(group="server", choices=("text", "json")),
            data_parallel_size=dict(group="parallel", aliases=("--dp-size",), metavar="N"),
            ray_address=dict(group="parallel", metavar="HOST:PORT"),
            ray_autoscaling_config=dict(group="parallel", metavar="JSON"),
        ),
        *flags_of(
            ModelConfig,
            "model",
            skip=["model"],
            preprocess_on_gpu=dict(option="--cpu-preprocess", negate=True),
            attention_backend=dict(choices=("auto", "torch", "triton")),
            quantization=dict(choices=QUANTIZATION_METHODS),
            tensor_parallel_size=dict(group="parallel", aliases=("--tp-size",), metavar="N"),
            nnodes=dict(group="parallel", metavar="N"),
            node_rank=dict(group="parallel", metavar="R"),
            dist_init_addr=dict(group="parallel", metavar="HOST:PORT"),
            mm_encoder_tp_mode=dict(group="parallel", choices=("driver", "data")),
        ),
        *flags_of(
            CacheConfig,
            "cache",
            num_blocks=dict(option="--num-kv-blocks"),
            enable_prefix_caching=dict(option="--no-prefix-caching", negate=True),
            kv_cache_dtype=dict(choices=("auto", "fp8", "fp8_e4m3")),
        ),
        *flags_of(
            SchedulerConfig,
            "scheduler",
            enable_chunked_prefill=dict(option="--no-chunked-prefill", negate=True),
            async_scheduling=dict(option="--no-async-scheduling", negate=True),
        ),
        *flags_of(
            ServerConfig,
            "server",
            skip=["decoupled", "max_batch_size"],
            http_port=dict(aliases=("--port",)),
            exit_timeout_s=dict(option="--exit-timeout-secs"),
            exclude_input_in_output=dict(both=True),
            skip_special_tokens=dict(both=True),
            http_restricted_api=restricted,
            grpc_restricted_protocol=restricted,
            allowed_origins=dict(group="security"),
            **{
                name: dict(group="security")
                for name in (
                    "api_key",
                    "ssl_certfile",
                    "ssl_keyfile",
                    "grpc_use_ssl",
                    "grpc_use_ssl_mutual",
                    "grpc_server_cert",
                    "grpc_server_key",
                    "grpc_root_cert",
                )
            },
        ),
        *flags_of(RequestLimits, "server", **_LIMITS_HELP),
        *flags_of(
            MediaConfig,
            "media",
            allow_private_urls=dict(option="--allow-private-media-urls", group="security"),
            allowed_local_media_path=dict(group="security"),
            fetch_timeout_s=dict(option="--media-fetch-timeout"),
            header_font_path=dict(option="--header-font", metavar="TTF"),
        ),
    )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `mmserve serve`, in groups, and `--config`."""
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flags from this YAML file (keys: flag names); also MMSERVE_CONFIG",
    )
    add_flags(p, serve_flags(), GROUPS)


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mmserve serve",
        description="Serve a checkpoint over HTTP (Triton, KServe, OpenAI) and gRPC.",
        epilog=EPILOG,
    )
    add_serve_args(p)
    return p


def parse_serve_args(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """`serve`'s arguments: the command line over the environment over the --config file over the defaults. A
    bad value on the command line stops with argparse's usage message; from the environment or the file, with
    one line naming the variable or the file's key; both status 2."""
    try:
        return resolve(
            serve_parser(),
            serve_flags(),
            argv,
            os.environ if environ is None else environ,
            ENV_PREFIX,
        )
    except ConfigError as exc:
        print(f"mmserve serve: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def explain(exc: ValueError, args: argparse.Namespace) -> str:
    """A builder's ValueError, prefixed with the flag, variable or file key its value came from."""
    return name_source(str(exc), serve_flags(), getattr(args, "sources", {}))


def _build(owner: type, args: argparse.Namespace, **fixed) -> object:
    """`owner` from the flags of its fields (and `fixed` values)."""
    values = {
        f.field: f.field_value(getattr(args, f.dest)) for f in serve_flags() if f.owner is owner
    }
    return owner(**{**values, **fixed})


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration that `serve`'s flags set (args.model: the checkpoint directory)."""
    return EngineConfig(
        model=_build(ModelConfig, args, model=args.model),
        cache=_build(CacheConfig, args),
        scheduler=_build(SchedulerConfig, args),
        limits=_build(RequestLimits, args),
    )


def build_media_config(args: argparse.Namespace) -> MediaConfig:
    """The limits on user media that `serve`'s flags set."""
    return _build(MediaConfig, args)


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    """The frontends' settings that `serve`'s flags set; the Triton max_batch_size is --max-num-seqs."""
    return _build(ServerConfig, args, max_batch_size=args.max_num_seqs)
