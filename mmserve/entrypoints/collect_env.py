"""`mmserve collect-env`: what a bug report needs — versions of mmserve and what it runs on, the GPUs, and the
environment variables that change its behaviour (secrets masked)."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

PACKAGES = (
    "torch",
    "torchvision",
    "triton",
    "transformers",
    "tokenizers",
    "huggingface-hub",
    "safetensors",
    "xgrammar",
    "av",
    "pillow",
    "numpy",
    "fastapi",
    "uvicorn",
    "grpcio",
    "tritonclient",
    "openai",
    "httpx",
)
ENV_PREFIXES = ("MMSERVE_", "HF_", "CUDA_", "NCCL_", "TORCH_", "PYTORCH_", "TRITON_")
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _gpus() -> list[str]:
    try:
        import torch
    except ImportError:
        return ["torch not importable"]
    if not torch.cuda.is_available():
        return ["none visible to torch"]
    lines = [f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"]
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        lines.append(
            f"{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
            f"compute capability {props.major}.{props.minor}"
        )
    return lines


def _memory_gib() -> str:
    try:
        return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    except (ValueError, OSError, AttributeError):
        return "unknown"


def environment_report() -> str:
    """The report, as text."""
    import mmserve

    lines = [
        f"mmserve {mmserve.__version__} ({os.path.dirname(mmserve.__file__)})",
        f"python {platform.python_version()} ({sys.executable})",
        f"platform {platform.platform()}",
        f"cpus {os.cpu_count()}, memory {_memory_gib()}",
        "",
        "packages:",
        *(f"  {name} {_version(name)}" for name in PACKAGES),
        "",
        "GPUs:",
        *(f"  {line}" for line in _gpus()),
        "",
        "environment:",
    ]
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIXES):
            value = os.environ[name]
            if any(word in name for word in SECRET_WORDS):
                value = "<set>"
            lines.append(f"  {name}={value}")
    return "\n".join(lines)
