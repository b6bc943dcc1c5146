"""`mmserve client` as a subprocess against a real server: the seed client's flags, tensors and printout."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from mmserve import LLM, SamplingParams
from mmserve.entrypoints.triton.prompts import build_prompt
from mmserve.testing import image_to_png_bytes, make_test_image

TEXT = "What is in this picture?"
OUTPUT_LEN = 10
LATENCY = re.compile(r"\[INFO\] Latency: \d+(\.\d{1,3})? ms")


@pytest.fixture(scope="module")
def offline(tiny_llava_dir) -> LLM:
    return LLM(tiny_llava_dir, device="cpu")


@pytest.fixture(scope="module")
def image_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("client-images") / "cat.png"
    path.write_bytes(image_to_png_bytes(make_test_image(11)))
    return str(path)


@pytest.fixture(scope="module")
def image_url(media_server) -> str:
    base, root = media_server
    (root / "client-dog.png").write_bytes(image_to_png_bytes(make_test_image(12)))
    return f"{base}/client-dog.png"


def run_client(server, *args: str, protocol: str = "grpc") -> subprocess.CompletedProcess:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    cmd = [
        sys.executable,
        "-m",
        "mmserve.entrypoints.cli",
        "client",
        "--url",
        url,
        "--protocol",
        protocol,
        "--model_type",
        "llava",
        "--text",
        TEXT,
        "--request-output-len",
        str(OUTPUT_LEN),
        *args,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"}
    )
    proc.stdout, proc.stderr = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")
    return proc


def printed_text(stdout: str, streaming: bool) -> str:
    """The generated text from the seed-format printout; checks the latency line ends it."""
    body, _, last = stdout.rstrip("\n").rpartition("\n")
    assert LATENCY.fullmatch(last), stdout
    if not streaming:
        head, _, text = body.partition("\n")
        assert head == "[beam 0 ]:", stdout
        return text
    assert body.startswith("[beam 0 ]:  "), stdout
    pieces = re.split(r"\n\[beam 0 \]:  ", body[len("[beam 0 ]:  ") :])
    return "".join(pieces)


def expected_completion(offline: LLM, image=None, pixel_values=None) -> str:
    prompt = {"prompt": build_prompt("llava", TEXT, 1)}
    if image is not None:
        prompt["images"] = [image]
    else:
        prompt["pixel_values"] = pixel_values
    return (
        offline.generate(
            prompt, SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("streaming", [False, True], ids=["plain", "streaming"])
def test_local_png_gives_the_offline_greedy_text(server, offline, image_path, protocol, streaming):
    proc = run_client(
        server, "--image", image_path, *(["--streaming"] if streaming else []), protocol=protocol
    )
    assert proc.returncode == 0, proc.stderr
    text = printed_text(proc.stdout, streaming)
    completion = expected_completion(offline, make_test_image(11))
    if streaming:  # streamed pieces carry only the new tokens
        assert text == completion
    else:  # non-streaming text_output includes the wrapped prompt (exclude_input_in_output false)
        assert text.endswith(completion) and TEXT in text and "ASSISTANT:" in text
    if protocol == "grpc":
        assert "sending raw image_bytes_input" in proc.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_image_url_is_fetched_client_side_and_bls_gives_the_same(
    server, offline, image_url, protocol
):
    completion = expected_completion(offline, make_test_image(12))
    for extra in ([], ["--use_bls"], ["--use_bls", "--streaming"]):
        proc = run_client(server, "--image", image_url, *extra, protocol=protocol)
        assert proc.returncode == 0, proc.stderr
        text = printed_text(proc.stdout, "--streaming" in extra)
        assert text.endswith(completion), (extra, text)


def test_hf_model_dir_sends_preprocessed_fp16_image_input(
    server, offline, image_path, tiny_llava_dir
):
    proc = run_client(
        server,
        "--image",
        image_path,
        "--hf_model_dir",
        tiny_llava_dir,
        "--prompt_table_extra_id",
        "7",
    )
    assert proc.returncode == 0, proc.stderr
    assert "image_bytes_input" not in proc.stderr
    processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    pixels = processor.image_processor([make_test_image(11)], return_tensors="pt")["pixel_values"]
    fp16 = torch.from_numpy(pixels.numpy().astype(np.float16).astype(np.float32))
    assert printed_text(proc.stdout, False).endswith(
        expected_completion(offline, pixel_values=fp16)
    )


def test_text_only_request_and_model_name_override(server, offline):
    proc = run_client(server, "--image", "", "--model_name", "tensorrt_llm_bls", "--streaming")
    assert proc.returncode == 0, proc.stderr
    expected = (
        offline.generate(
            build_prompt("llava", TEXT, 0),
            SamplingParams(max_tokens=OUTPUT_LEN, temperature=0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert printed_text(proc.stdout, True) == expected


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_errors_go_to_stderr_with_exit_code_1(server, image_path, protocol):
    proc = run_client(
        server, "--image", image_path, "--model_name", "no_such_model", protocol=protocol
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("[ERROR]") or "\n[ERROR]" in proc.stderr
    proc = run_client(server, "--image", image_path + ".missing", protocol=protocol)
    assert proc.returncode == 1 and "cannot read image" in proc.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_deplot_chart_question_through_the_client(tmp_path_factory, protocol):
    """--model_type pix2struct (beyond the seed's types): the chart goes as raw pixels, the question as the text,
    and the answer is the offline API's for the same picture and question."""
    from mmserve.testing.pix2struct import DEPLOT_PROMPT, make_pix2struct_checkpoint
    from tests.server.conftest import start_server

    root = tmp_path_factory.mktemp("client-deplot")
    model_dir = str(
        make_pix2struct_checkpoint(root / "deplot", preset="tiny", seed=0, progress=False)
    )
    chart = root / "chart.png"
    chart.write_bytes(image_to_png_bytes(make_test_image(5, (60, 40))))
    want = (
        LLM(model_dir, device="cpu")
        .generate(
            {"prompt": DEPLOT_PROMPT, "images": [make_test_image(5, (60, 40))]},
            SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    with start_server(model_dir, root) as server:
        url = server.grpc_url if protocol == "grpc" else server.http_url
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "mmserve.entrypoints.cli",
                "client",
                "--url",
                url,
                "--protocol",
                protocol,
                "--model_type",
                "pix2struct",
                "--text",
                DEPLOT_PROMPT,
                "--image",
                str(chart),
                "--request-output-len",
                str(OUTPUT_LEN),
            ],
            capture_output=True,
            timeout=120,
            text=True,
            env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        )
    assert proc.returncode == 0, proc.stderr
    assert printed_text(proc.stdout, streaming=False) == want


def test_streamed_beams_print_every_beam_of_every_response(server, image_path):
    """`-b 2 --streaming`: each streamed response holds both beams (whole), so the seed's loop over `-b` beams
    prints two lines per response; the last pair is what the same request answers without streaming."""
    streamed = run_client(server, "--image", image_path, "-b", "2", "--streaming")
    plain = run_client(server, "--image", image_path, "-b", "2")
    assert streamed.returncode == 0 and plain.returncode == 0, streamed.stderr + plain.stderr
    lines = [ln for ln in streamed.stdout.splitlines() if ln.startswith("[beam ")]
    assert len(lines) >= 4 and [ln[:9] for ln in lines] == ["[beam 0 ]", "[beam 1 ]"] * (
        len(lines) // 2
    )
    best = lines[-2].split(":  ", 1)[1]
    assert (
        best and best in plain.stdout
    )  # the plain answer prints the prompt, then the same best beam
