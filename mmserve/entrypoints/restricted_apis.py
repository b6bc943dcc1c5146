"""Triton's endpoint access limits: `--http-restricted-api APIS:KEY=VALUE` and `--grpc-restricted-protocol
APIS:KEY=VALUE` put groups of endpoints (`CATEGORIES`) behind a request header that must carry VALUE. Over HTTP
the header is KEY itself; over gRPC it is the metadata key `triton-grpc-protocol-<KEY>`. Refused requests get what
Triton answers: HTTP 403 `{"error": "This API is restricted, expecting header 'KEY'"}` (OpenAI-shaped on /v1
routes) and gRPC UNAVAILABLE "This protocol is restricted, expecting header '...'"; other endpoints stay open.

mmserve also places its own HTTP routes in these groups: the OpenAI completions and chat routes and /tokenize,
/detokenize under `inference`, /v1/models under `metadata`, /health under `health`, /metrics under `statistics` (with the model statistics)
(so an OpenAI client's key, `Authorization: Bearer <key>`, is `inference,metadata:Authorization=Bearer <key>`).

This module is the policy (parsing, which group a route or method is in) and imports no server package: ServerConfig
parses the options for every CLI command. The checks live with the servers: http_server.RestrictedApis (a pure-ASGI
middleware) and triton.grpc_interceptors.RestrictedProtocols (a grpc.aio interceptor)."""

from __future__ import annotations

import re
from dataclasses import dataclass

CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"

_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
# (method, path pattern, category) of every HTTP route that a restriction can cover; first match wins
_HTTP_ROUTES = [
    ("GET", re.compile(r"/v2/models(?:/[^/]+(?:/versions/[^/]+)?)?/stats|/metrics"), "statistics"),
    ("GET", re.compile(r"/v2/health/(?:live|ready)|/health"), "health"),
    ("GET", re.compile(_MODEL + "/ready"), "health"),
    ("GET", re.compile(_MODEL + "/config"), "model-config"),
    ("GET", re.compile(r"/v2|" + _MODEL + r"|/v1/models(?:/.*)?"), "metadata"),
    ("POST", re.compile(_MODEL + r"/(?:infer|generate|generate_stream)"), "inference"),
    ("POST", re.compile(r"/v1/(?:chat/)?completions|/tokenize|/detokenize"), "inference"),
    (
        "POST",
        re.compile(r"/v2/repository/(?:index|models/[^/]+/(?:load|unload))"),
        "model-repository",
    ),
]
_GRPC_METHODS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


@dataclass(frozen=True)
class Restriction:
    header: str  # lower case: HTTP header names and gRPC metadata keys compare that way
    value: str


def parse_restrictions(
    specs: list[str] | tuple[str, ...], option: str, header_prefix: str = ""
) -> dict[str, Restriction]:
    """{category: Restriction} from Triton-style specs "api1,api2:key=value"; a ValueError names the option and
    the spec for an unknown API, a missing key or value, or an API given in two groups."""
    restrictions: dict[str, Restriction] = {}
    for spec in specs:
        apis, sep, pair = spec.partition(":")
        key, eq, value = pair.partition("=")
        if not sep or not eq or not apis.strip() or not key.strip():
            raise ValueError(
                f"{option} '{spec}': expected APIS:KEY=VALUE, e.g. inference:my-key=secret"
            )
        for api in (a.strip() for a in apis.split(",")):
            if api not in CATEGORIES:
                raise ValueError(
                    f"{option} '{spec}': unknown API '{api}' (one of {', '.join(CATEGORIES)})"
                )
            if api in restrictions:
                raise ValueError(f"{option}: API '{api}' can not be in more than one group")
            restrictions[api] = Restriction((header_prefix + key.strip()).lower(), value)
    return restrictions


def http_category(method: str, path: str) -> str | None:
    """The restriction group of an HTTP request (None: no group covers it)."""
    for route_method, pattern, category in _HTTP_ROUTES:
        if method == route_method and pattern.fullmatch(path):
            return category
    return None


def grpc_category(method: str) -> str | None:
    """The restriction group of a gRPC method, given by its full name (`/inference.GRPCInferenceService/X`)."""
    return _GRPC_METHODS.get(method.rsplit("/", 1)[-1])
