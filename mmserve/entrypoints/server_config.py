"""ServerConfig: what `mmserve serve` listens on and the limits it enforces at the edge."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from urllib.parse import urlparse

from mmserve.entrypoints.restricted_apis import GRPC_HEADER_PREFIX, Restriction, parse_restrictions

API_KEY_GROUPS = (
    "inference,metadata"  # what --api-key covers; health and statistics stay open for probes
)


@dataclass
class ServerConfig:
    """The frontends' settings; each field's help is its `mmserve serve` flag's (entrypoints/serve_args.py)."""

    host: str = field(
        default="127.0.0.1", metadata=dict(help="address to listen on (0.0.0.0: every interface)")
    )
    http_port: int = field(
        default=8000,
        metadata=dict(help="HTTP port: Triton/KServe REST, OpenAI, /metrics (0: a free port)"),
    )
    grpc_port: int = field(
        default=8001,
        metadata=dict(help="KServe gRPC port (0: a free port; -1: no gRPC server)"),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=dict(
            help="the name the model is served under (OpenAI `model`, Triton's model list); none: the "
            "checkpoint directory's name, or the hub model ID"
        ),
    )
    max_request_bytes: int = field(
        default=64 * 2**20,
        metadata=dict(
            help="bytes of one HTTP request body (before decompression too) / gRPC message"
        ),
    )
    max_concurrent_requests: int = field(
        default=1024,
        metadata=dict(
            help="requests in flight; beyond this, 503 with Retry-After (gRPC UNAVAILABLE)"
        ),
    )
    exit_timeout_s: float = field(
        default=30.0,
        metadata=dict(
            help="at SIGTERM / SIGINT: readiness turns 503 and new requests get 503 (gRPC UNAVAILABLE) "
            "at once, requests in flight get this many seconds to finish, then the server exits 0; a "
            "second signal exits at once"
        ),
    )
    decoupled: bool = field(
        default=True,
        metadata=dict(
            help="Triton decoupled mode: ModelStreamInfer / generate_stream stream pieces"
        ),
    )
    accumulate_tokens: bool = field(
        default=False,
        metadata=dict(
            help="tensorrt_llm_bls streaming: each response carries all text so far (the seeds' "
            "accumulate_tokens parameter)"
        ),
    )
    # server-wide defaults of the Triton models, as the seeds' config.pbtxt parameters set them
    exclude_input_in_output: bool = field(
        default=False,
        metadata=dict(
            help="Triton models: text_output / output_ids without the prompt when a request does not "
            "send exclude_input_in_output (the seeds' tensorrt_llm parameter)"
        ),
    )
    skip_special_tokens: bool = field(
        default=True,
        metadata=dict(
            help="Triton text models: special tokens are left out of the generated text (the seeds' "
            "postprocessing parameter)"
        ),
    )
    log_requests: bool = field(
        default=False,
        metadata=dict(
            help="one log line per finished request: id, prompt / image / output tokens, TTFT, e2e "
            "seconds, finish reason"
        ),
    )
    max_batch_size: int = field(
        default=64,
        metadata=dict(
            help="the max_batch_size the Triton model configs report (`mmserve serve`: --max-num-seqs)"
        ),
    )
    # Triton's endpoint access limits, "APIS:KEY=VALUE" each (entrypoints/restricted_apis.py)
    http_restricted_api: tuple[str, ...] = field(
        default=(),
        metadata=dict(
            help="as Triton's: requests to these API groups (health, metadata, inference, model-config, "
            "model-repository, statistics, ...) need header KEY: VALUE, else 403; repeatable"
        ),
    )
    grpc_restricted_protocol: tuple[str, ...] = field(
        default=(),
        metadata=dict(
            help="as Triton's: gRPC calls of these groups need metadata triton-grpc-protocol-KEY: VALUE, "
            "else UNAVAILABLE; repeatable"
        ),
    )
    # sugar over the two options above
    api_key: str | None = field(
        default=None,
        repr=False,
        metadata=dict(
            help="clients must send `Authorization: Bearer KEY` (the OpenAI SDK's api_key; gRPC: the "
            "metadata triton-grpc-protocol-authorization) for inference and metadata; health stays "
            "open. The same as --http-restricted-api / --grpc-restricted-protocol "
            "'inference,metadata:Authorization=Bearer KEY'"
        ),
    )
    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata=dict(
            help="browser origins that may call the HTTP API (CORS), e.g. https://app.example.com; * for "
            "any; none: no CORS headers"
        ),
    )
    otlp_traces_endpoint: str | None = field(
        default=None,
        metadata=dict(
            help="send a trace of each request (spans preprocess, queue, vision_encode, prefill, decode) "
            "over OTLP/HTTP protobuf to this URL, e.g. http://localhost:4318/v1/traces; a caller's "
            "traceparent header (gRPC metadata) makes it part of the caller's trace. Needs "
            "pip install mmserve[otel]"
        ),
    )
    http_restrictions: dict[str, Restriction] = field(init=False, repr=False)
    grpc_restrictions: dict[str, Restriction] = field(init=False, repr=False)
    # TLS: HTTPS with a PEM certificate and key (uvicorn's); gRPC with Triton's options
    ssl_certfile: str | None = field(
        default=None,
        metadata=dict(help="serve HTTPS with this PEM certificate (and --ssl-keyfile)"),
    )
    ssl_keyfile: str | None = field(
        default=None, metadata=dict(help="the PEM private key of --ssl-certfile")
    )
    grpc_use_ssl: bool = field(
        default=False, metadata=dict(help="gRPC over TLS (--grpc-server-cert / --grpc-server-key)")
    )
    grpc_use_ssl_mutual: bool = field(
        default=False,
        metadata=dict(help="gRPC over TLS with client certificates signed by --grpc-root-cert"),
    )
    grpc_server_cert: str | None = field(
        default=None, metadata=dict(help="PEM certificate of the gRPC server")
    )
    grpc_server_key: str | None = field(
        default=None, metadata=dict(help="PEM private key of the gRPC server")
    )
    grpc_root_cert: str | None = field(
        default=None, metadata=dict(help="PEM CA certificate(s) that sign client certificates")
    )

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not -1 <= port <= 65535:
                raise ValueError(f"{name} must be a port number, got {port}")
        if not 0 <= self.exit_timeout_s < float("inf"):
            raise ValueError(f"exit_timeout_secs must be >= 0 seconds, got {self.exit_timeout_s}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        keyed = (f"{API_KEY_GROUPS}:authorization=Bearer {self.api_key}",) if self.api_key else ()
        option = "--http-restricted-api (with --api-key)" if keyed else "--http-restricted-api"
        self.http_restrictions = parse_restrictions(self.http_restricted_api + keyed, option)
        option = (
            "--grpc-restricted-protocol (with --api-key)" if keyed else "--grpc-restricted-protocol"
        )
        self.grpc_restrictions = parse_restrictions(
            self.grpc_restricted_protocol + keyed, option, GRPC_HEADER_PREFIX
        )
        self._check_tls()
        if self.otlp_traces_endpoint is not None:
            _check_otlp(self.otlp_traces_endpoint)

    def _check_tls(self) -> None:
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        self.grpc_use_ssl = self.grpc_use_ssl or self.grpc_use_ssl_mutual
        if self.grpc_use_ssl and not (self.grpc_server_cert and self.grpc_server_key):
            raise ValueError("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
        if self.grpc_use_ssl_mutual and not self.grpc_root_cert:
            raise ValueError(
                "--grpc-use-ssl-mutual needs --grpc-root-cert (the CA that signs client certificates)"
            )
        for option, path in [
            ("--ssl-certfile", self.ssl_certfile),
            ("--ssl-keyfile", self.ssl_keyfile),
            ("--grpc-server-cert", self.grpc_server_cert),
            ("--grpc-server-key", self.grpc_server_key),
            ("--grpc-root-cert", self.grpc_root_cert),
        ]:
            if path is not None and not os.access(path, os.R_OK):
                raise ValueError(f"{option}: cannot read {path}")


OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


def _check_otlp(url: str) -> None:
    """ValueError unless `url` is an http(s) URL and the OpenTelemetry packages are installed (found, not imported)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(
            f"otlp_traces_endpoint must be an http(s) URL such as http://localhost:4318/v1/traces, got {url!r}"
        )
    for module in OTEL_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            raise ValueError(
                "otlp_traces_endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter: "
                "pip install mmserve[otel]"
            )
