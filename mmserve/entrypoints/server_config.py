"""ServerConfig: what `mmserve serve` listens on and the limits it enforces at the edge."""
from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.entrypoints.restricted_apis import GRPC_HEADER_PREFIX, Restriction, parse_restrictions


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001              # 0 = pick a free port; -1 = no gRPC server
    served_model_name: str | None = None   # default: the checkpoint directory's name
    max_request_bytes: int = 64 * 2**20    # HTTP body / gRPC message cap
    max_concurrent_requests: int = 1024     # beyond this, 503 with Retry-After
    decoupled: bool = True             # Triton decoupled mode: ModelStreamInfer / generate_stream stream pieces
    accumulate_tokens: bool = False    # BLS streaming: each response carries all text so far (seed option)
    # Triton's endpoint access limits, "APIS:KEY=VALUE" each (entrypoints/restricted_apis.py)
    http_restricted_api: tuple[str, ...] = ()
    grpc_restricted_protocol: tuple[str, ...] = ()
    http_restrictions: dict[str, Restriction] = field(init=False, repr=False)
    grpc_restrictions: dict[str, Restriction] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not -1 <= port <= 65535:
                raise ValueError(f"{name} must be a port number, got {port}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        self.http_restrictions = parse_restrictions(self.http_restricted_api, "--http-restricted-api")
        self.grpc_restrictions = parse_restrictions(self.grpc_restricted_protocol, "--grpc-restricted-protocol",
                                                    GRPC_HEADER_PREFIX)
