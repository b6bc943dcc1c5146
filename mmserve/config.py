"""Engine configuration: one dataclass per area, each checked in __post_init__."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.sampling_params import RequestLimits

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZATION_METHODS = (
    "fp8",
    "int8",
    "int4",
)  # what `--quantization` converts to at load (int8/int4: weight-only)


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when present, else cpu. Raises ValueError on an unknown device string."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return torch.device(device)


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | None
) -> torch.dtype:
    """'auto' -> the checkpoint's dtype on GPU (fp32 kept as fp16), fp32 on CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of float32/float16/bfloat16, got {dtype}")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        ckpt = _DTYPES.get(str(checkpoint_dtype).replace("torch.", ""), torch.float16)
        return torch.float16 if ckpt == torch.float32 else ckpt
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """Which checkpoint, on which device, in which precision."""

    model: str  # path of a Hugging Face checkpoint directory
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda[:N]
    max_model_len: int | None = None  # prompt + output tokens; None = the checkpoint's limit
    seed: int = 0  # global sampling RNG seed
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    enforce_eager: bool = (
        False  # True: no CUDA graphs (decode steps, short prefills, vision towers)
    )
    preprocess_on_gpu: bool = (
        True  # on CUDA, resize/normalise images on the GPU (decoding stays on CPU)
    )
    # None: as the checkpoint is (FP8 checkpoints load as FP8); "fp8": decoder linears to e4m3 at load
    quantization: str | None = None
    max_loras: int = 8  # LoRA adapters loaded at once (Engine.add_lora)
    tensor_parallel_size: int = 1  # GPUs the language model is sharded over (one process each)

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto|torch|triton, got {self.attention_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be None or one of {list(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )
        resolve_device(self.device)  # fail early on bad strings
        if (
            not isinstance(self.dtype, torch.dtype)
            and self.dtype != "auto"
            and self.dtype not in _DTYPES
        ):
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )


@dataclass
class CacheConfig:
    """Paged KV cache. On GPU the pool is sized from free memory; on CPU from kv_cache_size_gb."""

    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # fixed pool size (overrides both sizing rules)
    kv_cache_memory_fraction: float = (
        0.9  # GPU: fraction of memory free after weights + activations
    )
    kv_cache_size_gb: float = 1.0  # CPU: bytes of KV pool, in GiB
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 16384  # vision embeddings (tokens) kept by content hash
    # final hidden states of computed prompts kept (one row of the LM's width each), so an exact repeat samples
    # its first token without a forward pass (engine/prompt_end_cache.py); 0: off. Needs prefix caching.
    prompt_end_cache_size: int = 1024
    # "auto": the model's dtype; "fp8" (= "fp8_e4m3"): e4m3 with a per-layer scale, half the bytes per token
    kv_cache_dtype: str = "auto"
    # cross-attention families (Mllama, the encoder-decoders): the part of the KV budget kept for the running
    # requests' encoder keys/values (TensorRT-LLM's cross_kv_cache_fraction); requests wait for room in it
    cross_kv_cache_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if not 0.0 < self.cross_kv_cache_fraction < 1.0:
            raise ValueError(
                f"cross_kv_cache_fraction must be in (0, 1), got {self.cross_kv_cache_fraction}"
            )
        if self.prompt_end_cache_size < 0:
            raise ValueError(
                f"prompt_end_cache_size must be >= 0, got {self.prompt_end_cache_size}"
            )
        if self.encoder_cache_size < 0:
            raise ValueError(f"encoder_cache_size must be >= 0, got {self.encoder_cache_size}")
        if self.kv_cache_size_gb <= 0:
            raise ValueError(f"kv_cache_size_gb must be > 0, got {self.kv_cache_size_gb}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype KV blocks are stored in."""
        return (
            model_dtype if self.kv_cache_dtype == "auto" else KV_CACHE_DTYPES[self.kv_cache_dtype]
        )


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    enable_chunked_prefill: bool = True  # a prompt may be split across steps anywhere
    max_waiting: int = 4096  # queued requests before add_request refuses (server: 503)
    async_scheduling: bool = True  # schedule + launch step N+1 before reading step N's tokens

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: RequestLimits = field(
        default_factory=RequestLimits
    )  # per request, checked before it is queued
