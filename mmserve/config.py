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
    "int4_g128",
    "w8a8",
)  # what `--quantization` converts to at load (int8/int4/int4_g128: weight-only; models/quantization.py)


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


def parse_host_port(addr: str) -> tuple[str, int]:
    """'HOST:PORT' (an IPv6 host in brackets) -> (host, port); ValueError naming dist_init_addr otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"dist_init_addr must be HOST:PORT with PORT in 1..65535, got {addr!r}")
    return host, int(port)


def check_nodes(size: int, nnodes: int | None, node_rank: int | None, addr: str | None) -> None:
    """ValueError (naming the field) when the node layout cannot hold `size` ranks."""
    if nnodes is not None and (not isinstance(nnodes, int) or nnodes < 1):
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}")
    nodes = nnodes or 1
    if size % nodes:
        raise ValueError(
            f"nnodes {nodes} does not divide tensor_parallel_size {size}: every node runs "
            "tensor_parallel_size / nnodes ranks"
        )
    if node_rank is not None and (not isinstance(node_rank, int) or not 0 <= node_rank < nodes):
        raise ValueError(f"node_rank must be in 0..{nodes - 1} (nnodes {nodes}), got {node_rank!r}")
    if addr is not None:
        parse_host_port(addr)
    elif nodes > 1:
        raise ValueError(
            f"--dist-init-addr HOST:PORT is needed with nnodes {nodes}: node 0's address and a free port, "
            "reachable from every node"
        )


@dataclass
class ModelConfig:
    """Which checkpoint, on which device, in which precision."""

    model: str = field(metadata=dict(help="path of a Hugging Face checkpoint directory"))
    dtype: str = field(
        default="auto",
        metadata=dict(
            help="weights and activations: auto (the checkpoint's on GPU, float32 kept as float16; "
            "float32 on CPU) | float32 | float16 | bfloat16"
        ),
    )
    device: str = field(
        default="auto", metadata=dict(help="auto (cuda when present, else cpu) | cpu | cuda[:N]")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=dict(help="prompt + output tokens of one request; none: the checkpoint's limit"),
    )
    seed: int = field(default=0, metadata=dict(help="global sampling RNG seed"))
    attention_backend: str = field(
        default="auto", metadata=dict(help="auto (triton on CUDA, torch on CPU) | torch | triton")
    )
    enforce_eager: bool = field(
        default=False,
        metadata=dict(help="no CUDA graphs (decode steps, short prefills, vision towers)"),
    )
    preprocess_on_gpu: bool = field(
        default=True,
        metadata=dict(
            help="on CUDA, resize and normalise images on the GPU (decoding stays on the CPU)"
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=dict(
            help="decoder linear layers at load: fp8 = e4m3 weights and activations (FP8 checkpoints "
            "need no flag); int8 / int4 = weights only (W8A16 / W4A16) with a scale per row; int4_g128 = "
            "weights only, int4 with a scale and zero per 128 input columns (the AWQ kernels); w8a8 = int8 "
            "weights and per-token int8 activations; AWQ / GPTQ / W8A8 checkpoints need no flag; none: as the "
            "checkpoint is"
        ),
    )
    max_loras: int = field(default=8, metadata=dict(help="LoRA adapters loaded at once"))
    tensor_parallel_size: int = field(
        default=1,
        metadata=dict(
            help="shard the language model over GPUs 0..N-1, one process each (TensorRT-LLM's --tp_size "
            "/ --world_size); the vision encoders run on GPU 0 (see --mm-encoder-tp-mode)"
        ),
    )
    mm_encoder_tp_mode: str = field(
        default="driver",
        metadata=dict(
            help="where the vision encoders run under tensor parallelism: driver (rank 0 encodes every "
            "picture; workers hold no encoder) | data (every rank keeps a replica of the vision tower and "
            "projector, a step's new pictures are split over the ranks by size and their embeddings gathered "
            "on rank 0, as vLLM's --mm-encoder-tp-mode data / SGLang's --mm-enable-dp-encoder; costs the "
            "encoder's weights on every worker; self-attention families only, others keep driver)"
        ),
    )
    nnodes: int | None = field(
        default=None,
        metadata=dict(
            help="machines the tensor-parallel group spans, tensor_parallel_size / nnodes GPUs each; "
            "none: torchrun's WORLD_SIZE or LeaderWorkerSet's LWS_GROUP_SIZE, else 1"
        ),
    )
    node_rank: int | None = field(
        default=None,
        metadata=dict(
            help="this machine's place, 0..nnodes-1: node 0 serves (global ranks 0..k-1), node r runs "
            "ranks r*k..r*k+k-1 headless; none: torchrun's GROUP_RANK or LWS_WORKER_INDEX, else 0"
        ),
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata=dict(
            help="HOST:PORT of node 0's rendezvous (a torch.distributed TCPStore that node 0 hosts), "
            "needed with nnodes > 1; none: torchrun's MASTER_ADDR:MASTER_PORT or LWS_LEADER_ADDRESS"
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}"
            )
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        check_nodes(self.tensor_parallel_size, self.nnodes, self.node_rank, self.dist_init_addr)
        if self.mm_encoder_tp_mode not in ("driver", "data"):
            raise ValueError(
                f"mm_encoder_tp_mode must be driver|data, got {self.mm_encoder_tp_mode!r}"
            )
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

    block_size: int = field(default=16, metadata=dict(help="tokens per KV block"))
    num_blocks: int | None = field(
        default=None,
        metadata=dict(
            help="fixed KV pool size in blocks (overrides both sizing rules); none: sized from memory"
        ),
    )
    kv_cache_memory_fraction: float = field(
        default=0.9,
        metadata=dict(
            help="GPU: the part of the memory free after the weights and the activation peak that the KV "
            "pool takes (TensorRT-LLM's kv_cache_free_gpu_mem_fraction)"
        ),
    )
    kv_cache_size_gb: float = field(default=1.0, metadata=dict(help="CPU: KV pool size, in GiB"))
    enable_prefix_caching: bool = field(
        default=True,
        metadata=dict(
            help="reuse the KV blocks of prompt prefixes (pictures included) computed before"
        ),
    )
    encoder_cache_size: int = field(
        default=16384,
        metadata=dict(
            help="vision-encoder outputs kept by picture content, in embedding rows (tokens), LRU"
        ),
    )
    # one row of the LM's width each (engine/prompt_end_cache.py)
    prompt_end_cache_size: int = field(
        default=1024,
        metadata=dict(
            help="prompts whose final hidden state is kept, so an exact repeat's first token needs no "
            "forward pass (0: off; needs prefix caching)"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=dict(
            help="auto: the model's dtype; fp8 (= fp8_e4m3): e4m3 blocks with a per-layer scale, half "
            "the memory and reads per token"
        ),
    )
    # a request whose encoder keys/values do not fit in this part of the pool waits for room
    cross_kv_cache_fraction: float = field(
        default=0.5,
        metadata=dict(
            help="cross-attention models (Mllama, Nougat, Deplot, BLIP-2 T5): the part of the KV budget "
            "kept for the running requests' encoder keys/values (TensorRT-LLM's "
            "cross_kv_cache_fraction)"
        ),
    )

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

    max_num_seqs: int = field(
        default=64,
        metadata=dict(
            help="requests running at once (also the Triton model config's max_batch_size)"
        ),
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata=dict(help="token budget of one step (prefill chunks + decodes)"),
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata=dict(help="a prompt may be split across steps anywhere")
    )
    max_waiting: int = field(
        default=4096,
        metadata=dict(
            help="requests queued in the engine before new ones are refused (server: 503)"
        ),
    )
    async_scheduling: bool = field(
        default=True,
        metadata=dict(
            help="schedule and launch step N+1 before reading step N's tokens back (host/GPU overlap)"
        ),
    )

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
