"""The flags of `mmserve serve` and the configurations they set: the engine's (`build_engine_config`), the
media limits (`build_media_config`) and the frontends' (`build_server_config`). Each raises ValueError for a bad value."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from mmserve.entrypoints.server_config import ServerConfig
from mmserve.sampling_params import RequestLimits

if TYPE_CHECKING:  # imported where used: parsing the flags needs neither torch nor the media code
    from mmserve.config import EngineConfig
    from mmserve.multimodal.media_limits import MediaConfig


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of `mmserve serve`."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF checkpoint directory (default: the embedded demo LLaVA)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001, help="-1 disables gRPC")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.9)
    p.add_argument(
        "--cross-kv-cache-fraction",
        type=float,
        default=0.5,
        help="cross-attention models (Mllama, Nougat, Deplot, BLIP-2 T5): the part of the KV budget kept "
        "for the running requests' encoder keys/values (TensorRT-LLM's cross_kv_cache_fraction)",
    )
    p.add_argument("--kv-cache-size-gb", type=float, default=1.0, help="KV pool size on CPU")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV pool size in blocks")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="auto: the model's dtype; fp8: e4m3 blocks, half the memory and reads per token",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["fp8", "int8", "int4"],
        help="decoder linear layers at load: fp8 = e4m3 weights and activations (FP8 checkpoints need no "
        "flag); int8 / int4 = weights only (W8A16 / W4A16)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--prompt-end-cache-size",
        type=int,
        default=1024,
        help="prompts whose final hidden state is kept, so an exact repeat's first token needs no "
        "forward pass (0: off)",
    )
    p.add_argument(
        "--encoder-cache-size",
        type=int,
        default=16384,
        help="vision-encoder outputs kept by picture content, in embedding rows (tokens), LRU",
    )
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="read each step's tokens back before scheduling the next (no host/GPU overlap)",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="with a hub model ID: the branch, tag or commit to serve (default: main)",
    )
    p.add_argument(
        "--download-dir",
        default=None,
        help="with a hub model ID: the cache to download into and read from (default: the hub cache, "
        "HF_HUB_CACHE / HF_HOME); HF_HUB_OFFLINE=1 reads the cache only, HF_TOKEN opens gated repos",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("MMSERVE_API_KEY"),
        help="clients must send `Authorization: Bearer KEY` (the OpenAI SDK's api_key; gRPC: the metadata "
        "triton-grpc-protocol-authorization) for inference and metadata; health stays open; default: "
        "$MMSERVE_API_KEY. The same as --http-restricted-api / --grpc-restricted-protocol "
        "'inference,metadata:Authorization=Bearer KEY'",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="browser origins that may call the HTTP API (CORS), e.g. https://app.example.com; * for any "
        "(default: none, no CORS headers)",
    )
    p.add_argument("--max-concurrent-requests", type=int, default=1024)
    p.add_argument(
        "--exit-timeout-secs",
        type=float,
        default=ServerConfig.exit_timeout_s,
        help="at SIGTERM / SIGINT: readiness turns 503 and new requests get 503 (gRPC UNAVAILABLE) at once, "
        "requests in flight get this long to finish, then the server exits 0; a second signal exits at "
        "once (default %(default)s)",
    )
    p.add_argument("--max-waiting", type=int, default=4096)
    p.add_argument("--max-request-bytes", type=int, default=64 * 2**20)
    p.add_argument(
        "--max-stop-sequences",
        type=int,
        default=RequestLimits.max_stop_sequences,
        help="entries of each stop / bad-word list of a request: stop strings, stop_token_ids, "
        "stop_words, bad_words, stop_words_list, bad_words_list (default %(default)s)",
    )
    p.add_argument(
        "--max-stop-sequence-chars",
        type=int,
        default=RequestLimits.max_stop_sequence_chars,
        help="characters (strings) or token ids (token lists) in all of each such list "
        "(default %(default)s)",
    )
    p.add_argument("--allow-private-media-urls", action="store_true")
    p.add_argument("--allowed-local-media-path", default=None)
    p.add_argument("--max-images-per-request", type=int, default=16)
    p.add_argument(
        "--max-media-bytes",
        type=int,
        default=32 * 2**20,
        help="encoded bytes of one image or video: download, data URI, tensor or file (default 32 MiB)",
    )
    p.add_argument("--max-image-pixels", type=int, default=64 * 2**20)
    p.add_argument(
        "--max-image-aspect-ratio",
        type=float,
        default=200.0,
        help="long edge / short edge of one image or video frame (default 200)",
    )
    p.add_argument(
        "--max-video-frames",
        type=int,
        default=64,
        help="frames sampled from one video (default 64)",
    )
    p.add_argument("--media-fetch-timeout", type=float, default=10.0)
    p.add_argument(
        "--header-font",
        default=None,
        metavar="TTF",
        help="font Pix2Struct VQA models (Deplot) read the question in (default: Arial.TTF in the model "
        "directory or the hub cache, else Pillow's built-in font)",
    )
    p.add_argument(
        "--accumulate-tokens", action="store_true", help="BLS streaming sends all text so far"
    )
    p.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        metavar="APIS:KEY=VALUE",
        help="as Triton's: requests to these API groups (health, metadata, inference, model-config, "
        "model-repository, statistics, ...) need header KEY: VALUE, else 403; repeatable",
    )
    p.add_argument(
        "--ssl-certfile",
        default=None,
        help="serve HTTPS with this PEM certificate (and --ssl-keyfile)",
    )
    p.add_argument("--ssl-keyfile", default=None, help="the PEM private key of --ssl-certfile")
    p.add_argument(
        "--grpc-use-ssl", action="store_true", help="gRPC over TLS (--grpc-server-cert/-key)"
    )
    p.add_argument(
        "--grpc-use-ssl-mutual",
        action="store_true",
        help="gRPC over TLS with client certificates signed by --grpc-root-cert",
    )
    p.add_argument("--grpc-server-cert", default=None, help="PEM certificate of the gRPC server")
    p.add_argument("--grpc-server-key", default=None, help="PEM private key of the gRPC server")
    p.add_argument(
        "--grpc-root-cert", default=None, help="PEM CA certificate(s) that sign client certificates"
    )
    p.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        metavar="APIS:KEY=VALUE",
        help="as Triton's: gRPC calls of these groups need metadata triton-grpc-protocol-KEY: VALUE, "
        "else UNAVAILABLE; repeatable",
    )
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (decode steps, short prefills, vision towers)",
    )
    p.add_argument(
        "--cpu-preprocess",
        action="store_true",
        help="resize/normalise images on the CPU even on CUDA",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="PEFT LoRA adapters to load; OpenAI requests name one as their `model`",
    )
    p.add_argument("--max-loras", type=int, default=8, help="LoRA adapters loaded at once")
    p.add_argument(
        "--tensor-parallel-size",
        "--tp-size",
        type=int,
        default=1,
        metavar="N",
        help="shard the language model over GPUs 0..N-1, one process each (TensorRT-LLM's --tp_size / "
        "--world_size); the vision encoders run on GPU 0",
    )
    p.add_argument("--log-level", default="info")


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration that `serve`'s flags set."""
    from mmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(
            args.model,
            dtype=args.dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            seed=args.seed,
            attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager,
            preprocess_on_gpu=not args.cpu_preprocess,
            quantization=args.quantization,
            max_loras=args.max_loras,
            tensor_parallel_size=args.tensor_parallel_size,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            cross_kv_cache_fraction=args.cross_kv_cache_fraction,
            kv_cache_size_gb=args.kv_cache_size_gb,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=not args.no_prefix_caching,
            prompt_end_cache_size=args.prompt_end_cache_size,
            encoder_cache_size=args.encoder_cache_size,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=not args.no_chunked_prefill,
            max_waiting=args.max_waiting,
            async_scheduling=not args.no_async_scheduling,
        ),
        limits=RequestLimits(
            max_stop_sequences=args.max_stop_sequences,
            max_stop_sequence_chars=args.max_stop_sequence_chars,
        ),
    )


def build_media_config(args: argparse.Namespace) -> MediaConfig:
    """The limits on user media that `serve`'s flags set."""
    from mmserve.multimodal.media_limits import MediaConfig

    return MediaConfig(
        allow_private_urls=args.allow_private_media_urls,
        allowed_local_media_path=args.allowed_local_media_path,
        fetch_timeout_s=args.media_fetch_timeout,
        max_image_pixels=args.max_image_pixels,
        max_image_aspect_ratio=args.max_image_aspect_ratio,
        max_video_frames=args.max_video_frames,
        max_images_per_request=args.max_images_per_request,
        max_media_bytes=args.max_media_bytes,
        header_font_path=args.header_font,
    )


def build_server_config(args: argparse.Namespace) -> ServerConfig:
    """The frontends' settings that `serve`'s flags set."""
    return ServerConfig(
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        served_model_name=args.served_model_name,
        max_request_bytes=args.max_request_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        exit_timeout_s=args.exit_timeout_secs,
        accumulate_tokens=args.accumulate_tokens,
        http_restricted_api=tuple(args.http_restricted_api),
        grpc_restricted_protocol=tuple(args.grpc_restricted_protocol),
        api_key=args.api_key,
        allowed_origins=tuple(args.allowed_origins),
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        grpc_use_ssl=args.grpc_use_ssl,
        grpc_use_ssl_mutual=args.grpc_use_ssl_mutual,
        grpc_server_cert=args.grpc_server_cert,
        grpc_server_key=args.grpc_server_key,
        grpc_root_cert=args.grpc_root_cert,
    )
