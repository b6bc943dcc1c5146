"""The Triton models mmserve answers for (`ensemble`, `tensorrt_llm_bls`, the token-level `tensorrt_llm`, the
checkpoint's own name) and the seeds' `preprocessing`, `multimodal_encoders`, `postprocessing` (aux_models.py): their
input/output tensor specs (PROTOCOL §1.1-§1.6), metadata and config answers, shared by REST and gRPC."""

from __future__ import annotations

from dataclasses import dataclass, replace

from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2

from mmserve.entrypoints.server_config import ServerConfig

ENSEMBLE, BLS, TRTLLM = "ensemble", "tensorrt_llm_bls", "tensorrt_llm"
MODEL_VERSION = "1"
ALIASES = {"min_length": "min_tokens", "random_seed": "seed"}  # old input names (PROTOCOL §0)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # wire name: BYTES, INT32, FP16, ...
    dims: tuple[int, ...]  # without the batch dimension
    optional: bool = True
    # another accepted shape (ensemble image_input: [batch, 3, H, W], one picture per item, as the XComposer2
    # seed's ensemble declares it)
    alt_dims: tuple[int, ...] | None = None


def _specs(text: str) -> tuple[TensorSpec, ...]:
    """'name DTYPE dims [req]' lines -> specs; dims like 1 or -1,-1 ."""
    out = []
    for line in text.strip().splitlines():
        name, dtype, dims, *req = line.split()
        out.append(
            TensorSpec(name, dtype, tuple(int(d) for d in dims.split(",")), optional=not req)
        )
    return tuple(out)


_COMMON_INPUTS = _specs("""
text_input BYTES 1 required
decoder_text_input BYTES 1
image_input FP16 -1,-1,-1,-1
image_bytes_input UINT8 -1,-1,-1,-1
image_url_input BYTES -1
image_sizes_input INT64 -1,2
video_bytes_input UINT8 -1,-1,-1,-1
max_tokens INT32 1 required
bad_words BYTES -1
stop_words BYTES -1
end_id INT32 1
pad_id INT32 1
top_k INT32 1
top_p FP32 1
temperature FP32 1
length_penalty FP32 1
repetition_penalty FP32 1
min_tokens INT32 1
presence_penalty FP32 1
frequency_penalty FP32 1
seed UINT64 1
return_log_probs BOOL 1
return_context_logits BOOL 1
return_generation_logits BOOL 1
beam_width INT32 1
stream BOOL 1
prompt_table_extra_id UINT64 1
embedding_bias_words BYTES -1
embedding_bias_weights FP32 -1
""")
_COMMON_INPUTS = tuple(
    replace(s, alt_dims=(3, -1, -1)) if s.name == "image_input" else s for s in _COMMON_INPUTS
)

_BLS_EXTRA_INPUTS = _specs("""
exclude_input_in_output BOOL 1
num_return_sequences INT32 1
prompt_embedding_table FP16 -1,-1
prompt_vocab_size INT32 1
num_draft_tokens INT32 1
use_draft_logits BOOL 1
lora_task_id UINT64 1
lora_weights FP16 -1,-1
lora_config INT32 -1,3
return_perf_metrics BOOL 1
guided_decoding_guide_type BYTES 1
guided_decoding_guide BYTES 1
""")


# the token-level model the ensembles call (PROTOCOL §1.5): token ids in, token ids out, no tokenizer; the inputs
# it shares with the text models keep their specs
def _named(specs: tuple[TensorSpec, ...], names: str) -> tuple[TensorSpec, ...]:
    by_name = {s.name: s for s in specs}
    return tuple(by_name[n] for n in names.split())


TRTLLM_INPUTS = (
    *_specs("""
input_ids INT32 -1 required
input_lengths INT32 1 required
prompt_table_extra_ids UINT64 -1
request_output_len INT32 1 required
stop_words_list INT32 2,-1
bad_words_list INT32 2,-1
embedding_bias FP32 -1
runtime_top_k INT32 1
runtime_top_p FP32 1
len_penalty FP32 1
streaming BOOL 1
stop BOOL 1
"""),
    *_named(
        _COMMON_INPUTS,
        "end_id pad_id beam_width temperature repetition_penalty min_tokens presence_penalty "
        "frequency_penalty seed return_log_probs return_context_logits return_generation_logits",
    ),
    *_named(
        _BLS_EXTRA_INPUTS,
        "exclude_input_in_output num_return_sequences lora_task_id lora_weights lora_config "
        "guided_decoding_guide_type guided_decoding_guide prompt_embedding_table "
        "prompt_vocab_size",
    ),
)

OUTPUTS = _specs("""
text_output BYTES -1
cum_log_probs FP32 -1
output_log_probs FP32 -1,-1
context_logits FP32 -1,-1
generation_logits FP32 -1,-1,-1
batch_index INT32 1
sequence_index INT32 1
""")

TRTLLM_OUTPUTS = (
    *_specs("""
output_ids INT32 -1,-1
sequence_length INT32 -1
"""),
    *OUTPUTS[1:],
)  # token ids instead of text_output

BLS_EXTRA_OUTPUTS = _specs("""
kv_cache_alloc_new_blocks INT32 1
kv_cache_reused_blocks INT32 1
kv_cache_alloc_total_blocks INT32 1
arrival_time_ns INT64 1
first_scheduled_time_ns INT64 1
first_token_time_ns INT64 1
last_token_time_ns INT64 1
acceptance_rate FP32 1
total_accepted_draft_tokens INT32 1
total_draft_tokens INT32 1
""")


# the seeds' other models (PROTOCOL §1.3, §1.4, §1.6), served by aux_models.py
PREPROCESSING = "preprocessing"
MM_ENCODERS = "multimodal_encoders"
POSTPROCESSING = "postprocessing"
AUX_INPUTS = {
    PREPROCESSING: _specs("""
QUERY BYTES 1 required
DECODER_QUERY BYTES 1
IMAGE_BYTES UINT8 -1,-1,-1,-1
IMAGE_URL BYTES -1
IMAGE_SIZES INT64 -1,2
VIDEO_BYTES UINT8 -1,-1,-1,-1
REQUEST_OUTPUT_LEN INT32 1 required
BAD_WORDS_DICT BYTES -1
STOP_WORDS_DICT BYTES -1
EMBEDDING_BIAS_WORDS BYTES -1
EMBEDDING_BIAS_WEIGHTS FP32 -1
END_ID INT32 1
PAD_ID INT32 1
PROMPT_TABLE_EXTRA_ID UINT64 1
"""),
    MM_ENCODERS: tuple(
        replace(s, alt_dims=(3, -1, -1)) if s.name in ("IMAGE", "pixel_values") else s
        for s in _specs("""
IMAGE FP16 -1,-1,-1,-1
pixel_values FP16 -1,-1,-1,-1
aspect_ratio_ids INT64 -1
aspect_ratio_mask INT64 -1,-1
cross_attention_mask INT64 -1,-1,-1
max_tokens INT32 1
image_sizes INT64 2
is_video_input BOOL 1
attention_mask INT64 -1
image_grid_thw INT64 3
vision_input_id INT32 -1
""")
    ),
    POSTPROCESSING: _specs("""
TOKENS_BATCH INT32 -1,-1 required
SEQUENCE_LENGTH INT32 -1 required
"""),
}
AUX_OUTPUTS = {
    PREPROCESSING: _specs("""
INPUT_ID INT32 -1
REQUEST_INPUT_LEN INT32 1
DECODER_INPUT_ID INT32 -1
REQUEST_DECODER_INPUT_LEN INT32 1
BAD_WORDS_IDS INT32 2,-1
STOP_WORDS_IDS INT32 2,-1
EMBEDDING_BIAS FP32 -1
REQUEST_OUTPUT_LEN INT32 -1
OUT_END_ID INT32 1
OUT_PAD_ID INT32 1
OUT_PROMPT_TABLE_EXTRA_IDS UINT64 -1
PIXEL_VALUES FP16 -1,-1,-1,-1
ASPECT_RATIO_IDS INT64 -1
ASPECT_RATIO_MASK INT64 -1,-1
CROSS_ATTENTION_MASK INT64 -1,-1,-1
IMAGE_SIZES INT64 2
IS_VIDEO_INPUT BOOL 1
ATTENTION_MASK INT64 -1
IMAGE_GRID_THW INT64 3
VISION_INPUT_ID INT32 -1
"""),
    MM_ENCODERS: _specs("""
OUT_PROMPT_EMBEDDING_TABLE FP16 -1,-1
OUT_PROMPT_VOCAB_SIZE INT32 1
ENCODER_INPUT_FEATURES FP16 -1,-1
ENCODER_OUTPUT_LENGTHS INT32 1
CROSS_ATTENTION_MASK BOOL -1,-1
SKIP_CROSS_ATTN_BLOCKS BOOL 1
MROPE_ROTARY_COS_SIN FP32 -1
MROPE_POSITION_DELTAS INT64 1
"""),
    POSTPROCESSING: _specs("""
OUTPUT BYTES -1
"""),
}


def _ensemble_inputs() -> tuple[TensorSpec, ...]:
    # the LoRA task tensors as the tensorrtllm_backend ensemble (and the XComposer2 seed's) declares them
    return (*_COMMON_INPUTS, *_named(_BLS_EXTRA_INPUTS, "lora_task_id lora_weights lora_config"))


def _bls_inputs() -> tuple[TensorSpec, ...]:
    base = [s for s in _COMMON_INPUTS if s.name != "image_sizes_input"]
    base = [
        TensorSpec(s.name, s.datatype, (-1, 3, -1, -1)) if s.name == "image_input" else s
        for s in base
    ]
    return (*base, *_BLS_EXTRA_INPUTS)


def _own_inputs() -> tuple[TensorSpec, ...]:
    return (
        *_COMMON_INPUTS,
        next(s for s in _BLS_EXTRA_INPUTS if s.name == "exclude_input_in_output"),
    )


def inputs_of(model: str) -> tuple[TensorSpec, ...]:
    """Input specs of a served model (`model` must be one of state.model_names)."""
    if model in AUX_INPUTS:
        return AUX_INPUTS[model]
    return {ENSEMBLE: _ensemble_inputs, BLS: _bls_inputs, TRTLLM: lambda: TRTLLM_INPUTS}.get(
        model, _own_inputs
    )()


def outputs_of(model: str) -> tuple[TensorSpec, ...]:
    if model in AUX_OUTPUTS:
        return AUX_OUTPUTS[model]
    if model == TRTLLM:
        return TRTLLM_OUTPUTS
    return (*OUTPUTS, *BLS_EXTRA_OUTPUTS) if model == BLS else OUTPUTS


# Every text model accepts every input name any of them declares (a superset of Triton), plus the old aliases;
# the token-level model takes its own (tokens.py).
ACCEPTED_INPUTS: dict[str, TensorSpec] = {s.name: s for s in (*_COMMON_INPUTS, *_BLS_EXTRA_INPUTS)}
for _old, _new in ALIASES.items():
    ACCEPTED_INPUTS[_old] = TensorSpec(
        _old, ACCEPTED_INPUTS[_new].datatype, ACCEPTED_INPUTS[_new].dims
    )


def platform_of(model: str) -> str:
    if model in AUX_INPUTS:  # python backend models in the seeds' repository
        return "python"
    return {ENSEMBLE: "ensemble", BLS: "python", TRTLLM: "tensorrtllm"}.get(model, "mmserve")


def has_sequence_parameters(model: str) -> bool:
    """Ensemble responses carry sequence_id/sequence_start/sequence_end parameters (PROTOCOL §2.2)."""
    return model == ENSEMBLE


def model_metadata(model: str) -> dict:
    """KServe model metadata: shapes are [-1] + dims since max_batch_size > 0."""

    def tensors(specs):
        return [{"name": s.name, "datatype": s.datatype, "shape": [-1, *s.dims]} for s in specs]

    return {
        "name": model,
        "versions": [MODEL_VERSION],
        "platform": platform_of(model),
        "inputs": tensors(inputs_of(model)),
        "outputs": tensors(outputs_of(model)),
    }


def _type_name(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def model_config(
    model: str,
    decoupled: bool,
    accumulate_tokens: bool,
    max_batch_size: int = ServerConfig.max_batch_size,
) -> model_config_pb2.ModelConfig:
    """The model's config as Triton would load it from config.pbtxt (the seeds' fill values);
    `max_batch_size`: the server's (ServerConfig.max_batch_size, `mmserve serve --max-num-seqs`)."""
    cfg = model_config_pb2.ModelConfig(name=model, max_batch_size=max_batch_size)
    if model == ENSEMBLE:
        cfg.platform = "ensemble"
    else:
        cfg.backend = platform_of(model)
        # the seeds' preprocessing, multimodal_encoders and postprocessing answer once per request
        cfg.model_transaction_policy.decoupled = decoupled and model not in AUX_INPUTS
    if model == BLS:
        cfg.parameters["accumulate_tokens"].string_value = str(accumulate_tokens)
    cfg.version_policy.latest.num_versions = 1
    for s in inputs_of(model):
        cfg.input.add(
            name=s.name,
            data_type=model_config_pb2.DataType.Value(_type_name(s.datatype)),
            dims=list(s.dims),
            optional=s.optional,
        )
    for s in outputs_of(model):
        cfg.output.add(
            name=s.name,
            data_type=model_config_pb2.DataType.Value(_type_name(s.datatype)),
            dims=list(s.dims),
        )
    if model == ENSEMBLE:  # the ensemble is decoupled when a composing model is (PROTOCOL §1.1)
        cfg.model_transaction_policy.decoupled = decoupled
    return cfg


def model_config_json(
    model: str,
    decoupled: bool,
    accumulate_tokens: bool,
    max_batch_size: int = ServerConfig.max_batch_size,
) -> dict:
    """model_config as Triton's REST answer: proto field names, primitives printed, int64 arrays as numbers."""
    msg = model_config(model, decoupled, accumulate_tokens, max_batch_size)
    data = json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _fix_int_arrays(data)


def _fix_int_arrays(node):
    if isinstance(node, dict):
        return {
            k: (
                [int(x) for x in v]
                if k in ("dims", "shape") and isinstance(v, list)
                else _fix_int_arrays(v)
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_fix_int_arrays(x) for x in node]
    return node
