"""The seeds' `preprocessing`, `multimodal_encoders` and `postprocessing` models against a real `mmserve serve` (the
tiny LLaVA), called with tritonclient HTTP and gRPC as a client of a Triton + tensorrtllm_backend repository calls
them: preprocessing tokenizes as the ensemble does (the pictures' runs as prompt-table ids from the vocabulary
size on), multimodal_encoders returns the model's own vision embeddings as that table, postprocessing decodes
token ids back, and the chain preprocessing -> multimodal_encoders -> tensorrt_llm -> postprocessing answers what
the ensemble answers. Bad tensors are 400s naming the input and the limit."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from mmserve import LLM, SamplingParams
from mmserve.testing import image_to_data_uri, make_test_image

TEXT = "What is in the picture?"
PRE, POST = "USER:\n", " ASSISTANT:"  # the llava family's prompt around text_input (PROTOCOL §6)


@pytest.fixture(scope="module")
def offline(tiny_llava_dir):
    return LLM(tiny_llava_dir, device="cpu")


@pytest.fixture(scope="module")
def http(server):
    return httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))


@pytest.fixture(scope="module")
def grpc(server):
    return grpcclient.InferenceServerClient(server.grpc_url)


def strings(*values: str) -> np.ndarray:
    return np.array([[v.encode()] for v in values], dtype=object)


def query(*texts: str, max_tokens: int = 4, **extra) -> dict[str, np.ndarray]:
    return {
        "QUERY": strings(*texts),
        "REQUEST_OUTPUT_LEN": np.full((len(texts), 1), max_tokens, np.int32),
        **extra,
    }


def infer(client, model: str, tensors: dict[str, np.ndarray], outputs=None) -> dict:
    """One infer call with binary tensors; all outputs the answer carries, by name."""
    mod = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    inputs = []
    for name, arr in tensors.items():
        inp = mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(arr, **({"binary_data": True} if mod is httpclient else {}))
        inputs.append(inp)
    wanted = [mod.InferRequestedOutput(o) for o in outputs] if outputs else None
    result = client.infer(model, inputs, outputs=wanted)
    response = result.get_response()
    if mod is grpcclient:
        names = [o.name for o in response.outputs]
    else:
        names = [o["name"] for o in response["outputs"]]
    return {n: result.as_numpy(n) for n in names}


def refused(client, model: str, tensors: dict[str, np.ndarray], outputs=None) -> str:
    with pytest.raises(InferenceServerException) as err:
        infer(client, model, tensors, outputs)
    status = str(err.value.status())
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), (status, err.value.message())
    return err.value.message()


def ensemble_ids(offline, text: str, images=None) -> list[int]:
    prompt = {"prompt": PRE + ("<image>" if images else "") + text + POST}
    if images:
        prompt["images"] = images
    return offline.engine.inputs.process(prompt).prompt_token_ids


# ---- the repository -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["preprocessing", "multimodal_encoders", "postprocessing"])
def test_listed_with_the_seeds_metadata_and_config(http, grpc, server, model):
    assert model in {m["name"] for m in http.get_model_repository_index()}
    assert model in {m.name for m in grpc.get_model_repository_index().models}
    assert http.is_model_ready(model) and grpc.is_model_ready(model)
    meta = http.get_model_metadata(model)
    # inputs last: preprocessing's REQUEST_OUTPUT_LEN is an input [1] and an output [-1]
    shapes = {t["name"]: (t["datatype"], t["shape"]) for t in meta["outputs"] + meta["inputs"]}
    want = {
        "preprocessing": {
            "QUERY": ("BYTES", [-1, 1]),
            "REQUEST_OUTPUT_LEN": ("INT32", [-1, 1]),
            "IMAGE_BYTES": ("UINT8", [-1, -1, -1, -1, -1]),
            "INPUT_ID": ("INT32", [-1, -1]),
            "STOP_WORDS_IDS": ("INT32", [-1, 2, -1]),
            "OUT_PROMPT_TABLE_EXTRA_IDS": ("UINT64", [-1, -1]),
            "PIXEL_VALUES": ("FP16", [-1, -1, -1, -1, -1]),
        },
        "multimodal_encoders": {
            "IMAGE": ("FP16", [-1, -1, -1, -1, -1]),
            "OUT_PROMPT_EMBEDDING_TABLE": ("FP16", [-1, -1, -1]),
            "OUT_PROMPT_VOCAB_SIZE": ("INT32", [-1, 1]),
        },
        "postprocessing": {
            "TOKENS_BATCH": ("INT32", [-1, -1, -1]),
            "SEQUENCE_LENGTH": ("INT32", [-1, -1]),
            "OUTPUT": ("BYTES", [-1, -1]),
        },
    }[model]
    assert {k: shapes[k] for k in want} == want
    assert meta["platform"] == "python"
    config = grpc.get_model_config(model).config
    assert config.backend == "python" and config.max_batch_size == 64
    assert not config.model_transaction_policy.decoupled
    required = {i.name for i in config.input if not i.optional}
    assert (
        required
        == {
            "preprocessing": {"QUERY", "REQUEST_OUTPUT_LEN"},
            "multimodal_encoders": set(),
            "postprocessing": {"TOKENS_BATCH", "SEQUENCE_LENGTH"},
        }[model]
    )
    rest = httpx.get(f"{server.http_url}/v2/models/{model}/config").json()
    assert rest["name"] == model and rest["max_batch_size"] == 64


# ---- preprocessing ---------------------------------------------------------------------------------------
def test_preprocessing_tokenizes_as_the_ensemble(http, grpc, offline):
    tok = offline.tokenizer
    texts = (TEXT, "Hi")
    stop = np.array([[b"ASSISTANT", b"Hello world"], [b"", b""]], dtype=object)
    got = infer(http, "preprocessing", query(*texts, max_tokens=7, STOP_WORDS_DICT=stop))
    rows = [ensemble_ids(offline, t) for t in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    assert got["REQUEST_INPUT_LEN"].tolist() == [[len(r)] for r in rows]
    for b, r in enumerate(rows):
        assert got["INPUT_ID"][b].tolist() == r + [pad] * (got["INPUT_ID"].shape[1] - len(r))
    assert got["INPUT_ID"].dtype == np.int32 and got["INPUT_ID"].shape == (2, max(map(len, rows)))
    assert got["OUT_END_ID"].tolist() == [[tok.eos_token_id]] * 2
    assert got["OUT_PAD_ID"].tolist() == [[pad]] * 2
    assert got["REQUEST_OUTPUT_LEN"].tolist() == [[7], [7]]
    words = [tok.encode(w, add_special_tokens=False) for w in ("ASSISTANT", "Hello world")]
    flat = words[0] + words[1]
    stops = got["STOP_WORDS_IDS"]
    assert stops.shape == (2, 2, len(flat))
    assert stops[0, 0].tolist() == flat
    assert stops[0, 1].tolist() == [len(words[0]), len(flat)] + [-1] * (len(flat) - 2)
    assert stops[1, 0].tolist() == [0] * len(flat) and stops[1, 1].tolist() == [-1] * len(flat)
    assert got["BAD_WORDS_IDS"].shape == (2, 2, 0) and got["EMBEDDING_BIAS"].shape == (2, 0)
    assert got["IS_VIDEO_INPUT"].tolist() == [[False], [False]]
    assert "PIXEL_VALUES" not in got and "OUT_PROMPT_TABLE_EXTRA_IDS" not in got
    over_grpc = infer(grpc, "preprocessing", query(*texts, max_tokens=7, STOP_WORDS_DICT=stop))
    assert over_grpc["INPUT_ID"].tolist() == got["INPUT_ID"].tolist()


def test_preprocessing_ids_end_pad_and_embedding_bias(http, offline):
    vocab = offline.engine.text_config.vocab_size
    got = infer(
        http,
        "preprocessing",
        query(
            TEXT,
            END_ID=np.array([[5]], np.int32),
            PAD_ID=np.array([[3]], np.int32),
            EMBEDDING_BIAS_WORDS=np.array([[b"picture"]], dtype=object),
            EMBEDDING_BIAS_WEIGHTS=np.array([[2.5]], np.float32),
        ),
    )
    assert got["OUT_END_ID"].tolist() == [[5]] and got["OUT_PAD_ID"].tolist() == [[3]]
    bias = got["EMBEDDING_BIAS"]
    assert bias.shape == (1, vocab) and bias.dtype == np.float32
    ids = offline.tokenizer.encode("picture")
    assert sorted(np.flatnonzero(bias[0]).tolist()) == sorted(set(ids))
    assert bias[0, ids[-1]] == pytest.approx(2.5 * ids.count(ids[-1]))


def test_preprocessing_puts_prompt_table_ids_where_the_picture_goes(http, offline):
    image = make_test_image(3)
    vocab = offline.engine.text_config.vocab_size
    got = infer(
        http,
        "preprocessing",
        query(
            TEXT,
            IMAGE_URL=strings(image_to_data_uri(image)),
            PROMPT_TABLE_EXTRA_ID=np.array([[42]], np.uint64),
        ),
    )
    processed = offline.engine.inputs.process(
        {"prompt": PRE + "<image>" + TEXT + POST, "images": [image]}
    )
    [item] = processed.mm_items
    want = list(processed.prompt_token_ids)
    want[item.offset : item.end] = range(vocab, vocab + item.length)
    assert got["INPUT_ID"][0].tolist() == want
    assert got["OUT_PROMPT_TABLE_EXTRA_IDS"][0].tolist() == [42 if t >= vocab else 0 for t in want]
    pixels = got["PIXEL_VALUES"]
    assert pixels.dtype == np.float16 and pixels.shape == (1, 1, *item.data["pixel_values"].shape)
    np.testing.assert_array_equal(
        pixels[0, 0], item.data["pixel_values"].numpy().astype(np.float16)
    )
    # the same picture as decoded pixels [batch, pictures, H, W, 3], two of them: their rows one after the other
    decoded = np.asarray(image, np.uint8)[None, None]
    two = infer(
        http,
        "preprocessing",
        query("<image> and <image>?", IMAGE_BYTES=np.concatenate([decoded, decoded], axis=1)),
    )
    ids = two["INPUT_ID"][0].tolist()
    table_ids = [t for t in ids if t >= vocab]
    assert table_ids == list(range(vocab, vocab + 2 * item.length))
    assert two["PIXEL_VALUES"].shape == (1, 2, *item.data["pixel_values"].shape)
    assert "OUT_PROMPT_TABLE_EXTRA_IDS" not in two


# ---- multimodal_encoders ----------------------------------------------------------------------------------
def test_multimodal_encoders_returns_the_models_vision_embeddings(http, grpc, offline):
    """The table is the model's own vision tower + projector output for the picture (computed here through the
    model object), as many rows as preprocessing's prompt-table ids for it."""
    vocab = offline.engine.text_config.vocab_size
    pre = infer(
        http, "preprocessing", query(TEXT, IMAGE_URL=strings(image_to_data_uri(make_test_image(4))))
    )
    pixels = pre["PIXEL_VALUES"]
    engine = offline.engine
    [item] = engine.inputs.process(
        {"prompt": "<image>", "pixel_values": torch.from_numpy(pixels[0].astype(np.float32))}
    ).mm_items
    want = engine.runner.encoder.encode([item])[item.content_hash].half().numpy()
    for client in (http, grpc):
        got = infer(client, "multimodal_encoders", {"IMAGE": pixels})
        table = got["OUT_PROMPT_EMBEDDING_TABLE"]
        assert table.dtype == np.float16 and table.shape == (1, *want.shape)
        np.testing.assert_allclose(table[0].astype(np.float32), want.astype(np.float32), atol=1e-3)
        assert got["OUT_PROMPT_VOCAB_SIZE"].tolist() == [[len(want)]]
        assert len(want) == int((pre["INPUT_ID"][0] >= vocab).sum())
    # the seeds' other name for the same input, two pictures of one item, a batch of two items
    two = infer(
        http, "multimodal_encoders", {"pixel_values": np.concatenate([pixels, pixels], axis=1)}
    )
    assert two["OUT_PROMPT_VOCAB_SIZE"].tolist() == [[2 * len(want)]]
    np.testing.assert_array_equal(two["OUT_PROMPT_EMBEDDING_TABLE"][0, len(want) :], table[0])
    batch = infer(http, "multimodal_encoders", {"IMAGE": np.concatenate([pixels, pixels])})
    assert batch["OUT_PROMPT_EMBEDDING_TABLE"].shape == (2, *want.shape)


def test_chain_answers_what_the_ensemble_answers(http, grpc, offline):
    """preprocessing -> multimodal_encoders -> tensorrt_llm -> postprocessing, as a client of the seeds'
    repository runs it by hand: the same tokens as the offline engine for that table, the same text as the
    ensemble; postprocessing gives the prompt's text back from preprocessing's ids."""
    uri = image_to_data_uri(make_test_image(6))
    pre = infer(http, "preprocessing", query(TEXT, IMAGE_URL=strings(uri)))
    enc = infer(grpc, "multimodal_encoders", {"IMAGE": pre["PIXEL_VALUES"]})
    n = 6
    ids = pre["INPUT_ID"]
    llm = infer(
        http,
        "tensorrt_llm",
        {
            "input_ids": ids,
            "input_lengths": pre["REQUEST_INPUT_LEN"],
            "request_output_len": np.array([[n]], np.int32),
            "runtime_top_k": np.ones((1, 1), np.int32),
            "end_id": pre["OUT_END_ID"],
            "pad_id": pre["OUT_PAD_ID"],
            "exclude_input_in_output": np.array([[True]]),
            "prompt_embedding_table": enc["OUT_PROMPT_EMBEDDING_TABLE"],
            "prompt_vocab_size": enc["OUT_PROMPT_VOCAB_SIZE"],
        },
        outputs=["output_ids", "sequence_length"],
    )
    table = torch.from_numpy(enc["OUT_PROMPT_EMBEDDING_TABLE"][0].astype(np.float32))
    want = offline.generate(
        {"prompt_token_ids": ids[0].tolist(), "prompt_table": table},
        SamplingParams(max_tokens=n, temperature=0.0),
        use_tqdm=False,
    )[0].outputs[0]
    length = int(llm["sequence_length"][0, 0])
    assert llm["output_ids"][0, 0, :length].tolist() == want.token_ids
    post = infer(
        grpc,
        "postprocessing",
        {"TOKENS_BATCH": llm["output_ids"], "SEQUENCE_LENGTH": llm["sequence_length"]},
    )
    assert post["OUTPUT"].shape == (1,) and post["OUTPUT"][0].decode() == want.text
    ensemble = infer(
        http,
        "ensemble",
        {
            "text_input": strings(TEXT),
            "max_tokens": np.array([[n]], np.int32),
            "top_k": np.ones((1, 1), np.int32),
            "image_url_input": strings(uri),
            "exclude_input_in_output": np.array([[True]]),
        },
        outputs=["text_output"],
    )
    assert ensemble["text_output"][0].decode() == post["OUTPUT"][0].decode()
    prompt_text = infer(
        http,
        "postprocessing",
        {"TOKENS_BATCH": ids[:, None], "SEQUENCE_LENGTH": pre["REQUEST_INPUT_LEN"]},
    )["OUTPUT"][0].decode()
    text_ids = [t for t in ids[0].tolist() if t < offline.engine.text_config.vocab_size]
    assert prompt_text == offline.tokenizer.decode(text_ids, skip_special_tokens=True)
    assert TEXT in prompt_text and "ASSISTANT:" in prompt_text


# ---- postprocessing ---------------------------------------------------------------------------------------
def test_postprocessing_round_trips_preprocessing_tokens(http, grpc, offline):
    texts = ("The cat sat on the mat.", "Hello")
    pre = infer(http, "preprocessing", query(*texts))
    tokens = np.stack([pre["INPUT_ID"], pre["INPUT_ID"]], axis=1)  # two beams each
    lengths = np.concatenate([pre["REQUEST_INPUT_LEN"], pre["REQUEST_INPUT_LEN"] - 1], axis=1)
    for client in (http, grpc):
        out = infer(client, "postprocessing", {"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": lengths})
        decoded = [s.decode() for s in out["OUTPUT"]]
        assert out["OUTPUT"].shape == (4,)
        for b in range(2):
            ids = pre["INPUT_ID"][b].tolist()
            n = int(pre["REQUEST_INPUT_LEN"][b, 0])
            full = offline.tokenizer.decode(ids[:n], skip_special_tokens=True)
            assert decoded[2 * b] == full and texts[b] in full
            assert decoded[2 * b + 1] == offline.tokenizer.decode(
                ids[: n - 1], skip_special_tokens=True
            )
