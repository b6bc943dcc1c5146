"""What every Triton model reads alike from its input tensors: one batch item's typed values (`BatchItem`), the
datatype / shape / batch checks of an input, and the inputs the text models and the token-level `tensorrt_llm`
model share (beam width, returned sequences, guided decoding, LoRA adapters), into a `TritonRequest`."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from mmserve.engine.beam_search import MAX_BEAM_WIDTH, unsupported_with_beams
from mmserve.entrypoints.server_config import ServerConfig
from mmserve.entrypoints.state import ServerState
from mmserve.entrypoints.triton.models import ACCEPTED_INPUTS
from mmserve.sampling_params import GUIDE_TYPES, SamplingParams

MAX_RETURN_SEQUENCES = 16  # sampled sequences of one prompt (each its own engine request)
LORA_HOW = (
    "send lora_weights and lora_config with lora_task_id once (TensorRT-LLM's format), or load the adapter "
    "at startup (--lora-modules TASK_ID=PATH); later requests name it with lora_task_id alone"
)


@dataclasses.dataclass
class TritonRequest:
    """One batch item of a Triton request, ready for state.generate."""

    model: str
    prompt: dict[str, Any]
    params: SamplingParams
    stream: bool = False
    exclude_input: bool | None = None  # None: not sent, the server's default (with_server_defaults)
    return_log_probs: bool = False
    image_field: str | None = None  # the input the images came from, for error messages
    beam_width: int = 1  # > 1: beam search (engine/beam_search.py), W completions
    num_return: int = 1  # beams returned, best first (num_return_sequences; beam_width by default)
    length_penalty: float = 1.0
    pad_id: int = 0  # tensorrt_llm: fills output_ids past a shorter sequence
    client_id: str = ""  # the request's Triton `id` (a later `stop` request names it)
    cancel: bool = False  # tensorrt_llm `stop`: abort the running requests of client_id instead


def with_server_defaults(req: TritonRequest, config: ServerConfig) -> TritonRequest:
    """The server-wide defaults where the request sets none, as the seeds' config.pbtxt parameters: `mmserve
    serve --exclude-input-in-output` (tensorrt_llm's) and `--no-skip-special-tokens` (postprocessing's)."""
    params = req.params
    if params.skip_special_tokens != config.skip_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=config.skip_special_tokens)
    exclude = config.exclude_input_in_output if req.exclude_input is None else req.exclude_input
    return dataclasses.replace(req, params=params, exclude_input=exclude)


_KINDS = {"BYTES": "bytes", "BOOL": "bool", "FP16": "float", "FP32": "float", "FP64": "float"}


def _kind(arr: np.ndarray) -> str:
    if arr.dtype == np.object_:
        return "bytes"
    if arr.dtype == np.bool_:
        return "bool"
    return "float" if np.issubdtype(arr.dtype, np.floating) else "int"


def check_tensor(
    model: str,
    name: str,
    arr: np.ndarray,
    batch: int,
    specs: dict | None = None,
    batch_input: str = "text_input",
) -> None:
    """An input's datatype, rank and batch size against its spec (`specs`: the model's, by name)."""
    spec = (ACCEPTED_INPUTS if specs is None else specs).get(name)
    if spec is None:
        raise ValueError(f"unexpected inference input '{name}' for model '{model}'")
    want, got = _KINDS.get(spec.datatype, "int"), _kind(arr)
    if got != want and not (want == "float" and got == "int"):
        raise ValueError(f"{name}: expected datatype {spec.datatype}, got {arr.dtype} ({got} data)")
    dims = spec.dims
    if spec.alt_dims is not None and arr.ndim == len(spec.alt_dims) + 1:
        dims = spec.alt_dims
    ndim_ok = arr.ndim == len(dims) + 1 or (dims == (1,) and arr.ndim == 1)
    fixed_ok = arr.ndim != len(dims) + 1 or all(
        d < 0 or d == n for d, n in zip(dims, arr.shape[1:])
    )
    if not (ndim_ok and fixed_ok):
        raise ValueError(
            f"{name}: expected shape [batch, {', '.join(map(str, spec.dims))}] (-1 = any), "
            f"got {list(arr.shape)}"
        )
    if arr.shape[0] != batch:
        raise ValueError(
            f"{name}: batch size {arr.shape[0]} does not match {batch_input}'s batch size {batch}"
        )


class BatchItem:
    """Typed access to batch item `b` of the request's tensors."""

    def __init__(self, tensors: dict[str, np.ndarray], b: int) -> None:
        self.tensors, self.b = tensors, b

    def values(self, name: str) -> np.ndarray | None:
        arr = self.tensors.get(name)
        return None if arr is None else arr[self.b].reshape(-1)

    def flag(self, name: str) -> bool | None:
        """A BOOL input's value; None when not sent."""
        v = self.scalar(name)
        return None if v is None else bool(v)

    def scalar(self, name: str, default: Any = None) -> Any:
        v = self.values(name)
        if v is None:
            return default
        if v.size != 1:
            raise ValueError(f"{name}: expected a single value per batch item, got {v.size}")
        return v[0].item() if isinstance(v[0], np.generic) else v[0]

    def strings(self, name: str) -> list[str]:
        v = self.values(name)
        try:
            return (
                []
                if v is None
                else [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in v]
            )
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}: not valid UTF-8 ({exc})") from exc


def guided_params(g: BatchItem) -> dict[str, Any]:
    """SamplingParams fields of TensorRT-LLM's guided decoding inputs (the guide is compiled when the engine takes
    the request)."""
    kind = g.strings("guided_decoding_guide_type")
    if not kind:
        return {}
    if kind[0] not in GUIDE_TYPES:
        raise ValueError(
            f"guided_decoding_guide_type must be one of {', '.join(GUIDE_TYPES)}, got {kind[0]!r}"
        )
    guide = [x for x in g.strings("guided_decoding_guide") if x]
    if kind[0] != "json" and not guide:
        raise ValueError(
            f"guided_decoding_guide: needed for guided_decoding_guide_type {kind[0]!r}"
        )
    return {"guided_decoding_type": kind[0], "guided_decoding_guide": guide[0] if guide else None}


async def lora_name(state: ServerState, g: BatchItem) -> str | None:
    """The adapter lora_task_id names (loading one sent with the request first), or None."""
    task = g.scalar("lora_task_id")
    await load_lora(state, g, task)
    if task is None:
        return None
    if str(int(task)) not in state.lora_names:
        raise ValueError(
            f"lora_task_id: LoRA task {int(task)} is not loaded (loaded: "
            f"{', '.join(state.lora_names) or 'none'}); {LORA_HOW}"
        )
    return str(int(task))


async def load_lora(state: ServerState, g: BatchItem, task: Any) -> None:
    """An adapter sent with the request (lora_weights + lora_config, TensorRT-LLM's format) is cached as its
    lora_task_id, on the engine thread."""
    weights, config = g.tensors.get("lora_weights"), g.tensors.get("lora_config")
    if weights is None and config is None:
        return
    if weights is None or config is None:
        missing = "lora_weights" if weights is None else "lora_config"
        raise ValueError(f"{missing}: missing; lora_weights and lora_config are sent together")
    if task is None:
        raise ValueError("lora_weights: needs lora_task_id, the id the adapter is cached under")
    w, c = weights[g.b], config[g.b].reshape(-1, 3) if config[g.b].size % 3 == 0 else config[g.b]
    if w.ndim == 2 and w.shape[0] == 1 and len(c) > 1 and w.size % len(c) == 0:
        w = w.reshape(len(c), -1)  # the generate extension sends a JSON array as one row
    await state.engine.add_lora_tensors(str(int(task)), w, c)


def num_return_sequences(g: BatchItem, width: int) -> int:
    """With beams, the N best of the W (default W); without, N sequences sampled for the prompt (default 1)."""
    num_return = int(g.scalar("num_return_sequences", width))
    if width > 1 and not 1 <= num_return <= width:
        raise ValueError(
            f"num_return_sequences must be in [1, beam_width = {width}], got {num_return}"
        )
    if width == 1 and not 1 <= num_return <= MAX_RETURN_SEQUENCES:
        raise ValueError(
            f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], got {num_return}"
        )
    return num_return


def beam_width(g: BatchItem, params: SamplingParams) -> int:
    """The request's beam_width, checked against what beam search here supports."""
    width = int(g.scalar("beam_width", 1))
    if width == 1:
        return 1
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise ValueError(f"beam_width must be in [1, {MAX_BEAM_WIDTH}], got {width}")
    field = unsupported_with_beams(params)
    if field is not None:
        raise ValueError(f"{field}: not supported with beam_width > 1 yet")
    return width
