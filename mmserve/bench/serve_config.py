"""Settings of `mmserve bench serve` (ServeConfig), checked and normalised when made."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mmserve.bench.workload import ModelSource

PROTOCOLS = ("triton-http", "triton-grpc", "openai")


@dataclass
class ServeConfig:
    """Settings of one load-generator run."""

    url: str  # http://HOST:PORT (HTTP protocols) or HOST:PORT (gRPC)
    protocol: str = "triton-http"  # triton-http | triton-grpc | openai
    model_name: str | None = None  # triton: "ensemble"; openai: the server's first model
    request_rates: list[float] = field(
        default_factory=lambda: [1.0, 4.0, 16.0]
    )  # req/s; inf = all at once
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 32])
    num_requests: int = 64  # per sweep point
    input_len: int = 128  # user text tokens (exact with a tokenizer, else words)
    output_len: int = 128  # forced: min_tokens = max_tokens (+ ignore_eos for openai)
    max_duration_s: float = 120.0  # no new request of a point after this
    request_timeout_s: float = 300.0
    warmup: int = 2  # untimed requests before the sweeps
    image_size: int = 336  # side of the synthetic images
    unique_images: bool = True  # distinct images: no encoder/prefix cache hits
    source: ModelSource | None = None  # tokenizer for exact input_len; needed by the hf baseline
    baseline: str = "none"  # hf | none
    device: str = "cpu"  # hf baseline only
    dtype: str = "float32"  # hf baseline only
    hf_attn: str | None = None  # hf baseline: attn_implementation (None = its default)
    seed: int = 0
    # sent with every request: HTTP headers, or gRPC metadata (a Triton server started with
    # --grpc-restricted-protocol wants `triton-grpc-protocol-<key>`)
    headers: dict[str, str] = field(default_factory=dict)
    label: str | None = None  # the measured server's name in the results; None: ask the server
    goodput: dict[str, float] = field(default_factory=dict)  # SLO limits in ms: ttft / tpot / e2e
    dataset: str | None = None  # a JSONL of requests (bench/dataset.py) instead of synthetic ones
    output_len_fixed: bool = True  # False: a dataset line's own output length wins over output_len

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.num_requests < 1 or self.output_len < 1 or self.input_len < 0:
            raise ValueError("need num_requests >= 1, output_len >= 1, input_len >= 0")
        if any(r <= 0 for r in self.request_rates) or any(c < 1 for c in self.concurrencies):
            raise ValueError("request rates must be > 0 and concurrencies >= 1")
        if self.max_duration_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("max_duration_s and request_timeout_s must be > 0")
        if self.baseline not in ("hf", "none"):
            raise ValueError(f"baseline must be hf or none, got {self.baseline!r}")
        if self.baseline == "hf" and self.source is None:
            raise ValueError(
                "--baseline hf needs --model or --preset (the checkpoint the server runs)"
            )
        if self.dataset is not None and self.baseline == "hf":
            raise ValueError("--dataset runs the server only: use --baseline none")
        if (
            self.dataset is not None
        ):  # a malformed line or a missing picture: refused before any load
            from mmserve.bench.dataset import load_dataset

            load_dataset(self.dataset, self.num_requests, note=False)
        if self.label is not None and not self.label.strip():
            raise ValueError("--label must not be empty")
        if self.protocol == "triton-grpc":
            self.url = self.url.split("://", 1)[-1].rstrip("/")
        elif urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"{self.protocol} needs an http(s):// URL, got {self.url!r}")
        else:
            self.url = self.url.rstrip("/")
