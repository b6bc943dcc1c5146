"""`mmserve quantize` as a subprocess on a tiny random llava (CPU, 4 calibration samples with pictures): the AWQ
checkpoint in AutoAWQ's GEMM layout and the SmoothQuant one in compressed-tensors W8A8, under the checkpoint's own
names, everything else copied unchanged; a JSONL calibration file; bad arguments exit 2 with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmserve.testing import make_checkpoint, make_llava_checkpoint, make_test_image
from tests.checkpoint_files import file_tensors

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmserve.entrypoints.cli", "quantize", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """hidden 128, intermediate 256 (group 64 divides both), MHA (the v -> o site), 8 shards with an index."""
    return make_llava_checkpoint(
        tmp_path_factory.mktemp("quant_src"),
        preset="tiny-mha",
        text_hidden=128,
        text_intermediate=256,
        max_shard_bytes=400_000,
    )


def _decoder_stem(key: str) -> str | None:
    stem, _, leaf = key.rpartition(".")
    return stem if ".layers." in key and "language_model" in key and stem.endswith(PROJ) else None


def _check_copied(src: Path, out: Path, written: dict[str, torch.Tensor]) -> None:
    """Tensors outside the decoder linears and norms bit for bit as they were; the side files byte for byte;
    the index maps exactly the keys in the files."""
    for key, value in file_tensors(src).items():
        if _decoder_stem(key) is None and "layernorm" not in key:
            assert torch.equal(written[key], value), key
    for name in ("tokenizer.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(written)
    assert index["metadata"]["total_size"] == sum(
        p.stat().st_size for p in out.glob("*.safetensors")
    )


def test_awq_subprocess_writes_autoawq_gemm_layout(src, tmp_path):
    out = tmp_path / "awq"
    run = quantize_cli(
        str(src), str(out), "--calib-size", "4", "--group-size", "64", "--device", "cpu"
    )
    assert run.returncode == 0, run.stderr
    assert "awq, 12 decoder linears, 4 calibration samples" in run.stdout
    original, written = file_tensors(src), file_tensors(out)
    stems = {s for k in original if (s := _decoder_stem(k))}
    assert len(stems) == 3 * len(PROJ)
    for stem in stems:
        n, k = original[f"{stem}.weight"].shape
        assert f"{stem}.weight" not in written
        assert written[f"{stem}.qweight"].dtype == torch.int32
        assert written[f"{stem}.qweight"].shape == (k, n // 8)
        assert written[f"{stem}.qzeros"].dtype == torch.int32
        assert written[f"{stem}.qzeros"].shape == (k // 64, n // 8)
        assert written[f"{stem}.scales"].dtype == torch.float16
        assert written[f"{stem}.scales"].shape == (k // 64, n)
    norms = [k for k in original if "layernorm" in k and "language_model" in k]
    assert any(
        not torch.equal(written[k], original[k]) for k in norms
    )  # the scales folded into them
    assert all(written[k].dtype == original[k].dtype for k in norms)
    _check_copied(src, out, written)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "modules_to_not_convert": [
            "language_model.lm_head",
            "language_model.model.embed_tokens",
            "multi_modal_projector",
            "vision_tower",
        ],
    }
    assert config["text_config"] == json.loads((src / "config.json").read_text())["text_config"]


def test_smoothquant_subprocess_writes_compressed_tensors_w8a8(src, tmp_path):
    out = tmp_path / "sq"
    run = quantize_cli(
        str(src), str(out), "--method", "smoothquant", "--calib-size", "4", "--alpha", "0.6"
    )
    assert run.returncode == 0, run.stderr
    original, written = file_tensors(src), file_tensors(out)
    for stem in {s for k in original if (s := _decoder_stem(k))}:
        n, k = original[f"{stem}.weight"].shape
        assert written[f"{stem}.weight"].dtype == torch.int8
        assert written[f"{stem}.weight"].shape == (n, k)
        assert written[f"{stem}.weight_scale"].shape == (n, 1)
        assert written[f"{stem}.weight_scale"].dtype == original[f"{stem}.weight"].dtype
        assert int(written[f"{stem}.weight"].abs().max()) >= 127  # each row's max maps to 127
    _check_copied(src, out, written)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "int-quantized")
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert {
        k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "dynamic")
    } == {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
    }
    acts = group["input_activations"]
    assert (acts["num_bits"], acts["strategy"], acts["dynamic"], acts["symmetric"]) == (
        8,
        "token",
        True,
        True,
    )
    assert qc["ignore"] == [
        "language_model.lm_head",
        "language_model.model.embed_tokens",
        "re:multi_modal_projector\\..*",
        "re:vision_tower\\..*",
    ]


def test_calibration_file_of_prompts_and_pictures(src, tmp_path):
    for i in range(2):
        make_test_image(i, (64, 48)).save(tmp_path / f"pic{i}.png")
    lines = [
        {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "images": ["pic0.png"]},
        {
            "prompt": "USER: <image>\n<image>\nCompare them. ASSISTANT:",
            "images": ["pic0.png", "pic1.png"],
        },
        {"prompt": "USER: not read: --calib-size 2 ASSISTANT:", "images": []},
    ]
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    args = [str(src), str(tmp_path / "out"), "--method", "smoothquant", "--calib-data", str(data)]
    run = quantize_cli(*args, "--calib-size", "2")
    assert run.returncode == 0, run.stderr
    assert "2 calibration samples" in run.stdout
    data.write_text(json.dumps(lines[0]) + "\n" + '{"prompt": 3}\n')
    bad = quantize_cli(str(src), str(tmp_path / "out2"), "--calib-data", str(data))
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        f'mmserve quantize: error: {data}:2: expected an object with a string "prompt"'
    ]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--method", "gptq"], "argument --method: invalid choice: 'gptq'"),
        (["--calib-size", "0"], "calib_size must be >= 1, got 0"),
        (["--calib-data", "/nonexistent/calib.jsonl"], "calib_data: no such file"),
        (["--alpha", "1.5"], "alpha must be in [0, 1], got 1.5"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(src, tmp_path, args, expected):
    run = quantize_cli(str(src), str(tmp_path / "out"), *args)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], run.stderr
    assert not (tmp_path / "out").exists()


def test_unsupported_family_and_bad_shapes_exit_2_naming_them(src, tmp_path):
    blip2 = make_checkpoint("blip2", tmp_path / "blip2")
    run = quantize_cli(str(blip2), str(tmp_path / "out"))
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert "family 'blip2' is not supported" in line
    assert "supported: llava, llava_next, llava_onevision, pixtral, qwen2_vl, vila" in line
    run = quantize_cli(str(src), str(tmp_path / "out"), "--calib-size", "1", "--group-size", "96")
    assert run.returncode == 2
    assert "group_size 96 does not divide in_features 128" in run.stderr.strip().splitlines()[-1]
