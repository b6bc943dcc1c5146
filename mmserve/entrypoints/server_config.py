"""ServerConfig: what `mmserve serve` listens on and the limits it enforces at the edge."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mmserve.entrypoints.restricted_apis import GRPC_HEADER_PREFIX, Restriction, parse_restrictions

API_KEY_GROUPS = (
    "inference,metadata"  # what --api-key covers; health and statistics stay open for probes
)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001  # 0 = pick a free port; -1 = no gRPC server
    served_model_name: str | None = None  # default: the checkpoint directory's name
    max_request_bytes: int = 64 * 2**20  # HTTP body / gRPC message cap
    max_concurrent_requests: int = 1024  # beyond this, 503 with Retry-After
    # at SIGTERM: readiness 503 and new requests refused at once, those in flight get this long to finish
    exit_timeout_s: float = 30.0
    decoupled: bool = (
        True  # Triton decoupled mode: ModelStreamInfer / generate_stream stream pieces
    )
    accumulate_tokens: bool = (
        False  # BLS streaming: each response carries all text so far (seed option)
    )
    # Triton's endpoint access limits, "APIS:KEY=VALUE" each (entrypoints/restricted_apis.py)
    http_restricted_api: tuple[str, ...] = ()
    grpc_restricted_protocol: tuple[str, ...] = ()
    # OpenAI-style key: the inference and metadata APIs need `Authorization: Bearer <key>` (gRPC: the metadata
    # `triton-grpc-protocol-authorization`); sugar over the two options above
    api_key: str | None = field(default=None, repr=False)
    # browser origins allowed to call the API (CORS); "*" allows any; none: no CORS headers are sent
    allowed_origins: tuple[str, ...] = ()
    http_restrictions: dict[str, Restriction] = field(init=False, repr=False)
    grpc_restrictions: dict[str, Restriction] = field(init=False, repr=False)
    # TLS: HTTPS with a PEM certificate and key (uvicorn's); gRPC with Triton's options (mutual: clients must
    # present a certificate signed by grpc_root_cert)
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    grpc_use_ssl: bool = False
    grpc_use_ssl_mutual: bool = False
    grpc_server_cert: str | None = None
    grpc_server_key: str | None = None
    grpc_root_cert: str | None = None

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
