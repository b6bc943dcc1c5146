"""`--dataset FILE.jsonl` (the three line layouts, pictures from disk or embedded), `--goodput` objectives and
`--label` / the server's own name, against a real `mmserve serve` on 127.0.0.1 and offline."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from mmserve.bench.cli import main
from mmserve.bench.dataset import DatasetError, load_dataset
from mmserve.bench.goodput import parse_goodput
from mmserve.bench.serve_metrics import Record, summarize
from mmserve.bench.serve_workload import dataset_requests
from tests.conftest import strict_json


def _write_dataset(folder: Path) -> Path:
    """A PNG and a JPEG beside the file, a picture by absolute path, both line formats."""
    Image.effect_noise((40, 30), 60).convert("RGB").save(folder / "a.png")
    Image.effect_noise((32, 32), 20).convert("RGB").save(folder / "b.jpg", quality=90)
    (folder / "sub").mkdir()
    Image.effect_noise((36, 28), 90).convert("RGB").save(folder / "sub" / "c.png")
    lines = [
        {"prompt": "What is in the picture?", "images": ["a.png"], "output_len": 3},
        {
            "image": "b.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nDescribe it."},
                {"from": "gpt", "value": "a grey square"},
            ],
        },
        {"prompt": "And this one?", "images": [str(folder / "sub" / "c.png")]},
    ]
    path = folder / "requests.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    return path


def test_dataset_lines_give_prompts_pictures_and_output_lengths(tmp_path):
    path = _write_dataset(tmp_path)
    reqs = load_dataset(str(path), 3)
    assert [r.prompt for r in reqs] == ["What is in the picture?", "Describe it.", "And this one?"]
    assert [r.images for r in reqs] == [
        (tmp_path / "a.png",),
        (tmp_path / "b.jpg",),
        (tmp_path / "sub" / "c.png",),
    ]
    assert [r.image_sizes for r in reqs] == [((40, 30),), ((32, 32),), ((36, 28),)]
    assert [r.output_len for r in reqs] == [3, 3, None]  # the gpt turn's words without a tokenizer
    assert reqs[1].read_images()[0].size == (32, 32)
    five = load_dataset(str(path), 5, count_tokens=lambda text: 7)
    assert [r.line for r in five] == [1, 2, 3, 1, 2] and five[1].output_len == 7


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def test_visionarena_lines_read_pictures_by_path_and_embedded_as_base64_bytes(tmp_path):
    """lmarena-ai/VisionArena-Chat rows as a JSONL export: `conversation` holds the turns, each a one-message
    list (flat turns too), `images` holds paths, `datasets` Image values `{"path"}`, or `{"bytes": base64}`."""
    (tmp_path / "pics").mkdir()
    Image.effect_noise((40, 30), 60).convert("RGB").save(tmp_path / "pics" / "a.png")
    Image.effect_noise((32, 24), 30).convert("RGB").save(tmp_path / "pics" / "b.jpg", quality=90)
    png = _encoded(Image.effect_noise((24, 20), 80).convert("RGB"), "PNG")
    jpeg = _encoded(Image.effect_noise((50, 18), 40).convert("RGB"), "JPEG")
    row = {"conversation_id": "c1", "model": "gpt-4o", "num_turns": 1, "language": "English"}
    lines = [
        {
            **row,
            "images": ["pics/a.png"],
            "conversation": [
                [{"role": "user", "content": "What is this?"}],
                [{"role": "assistant", "content": "a noisy picture"}],
            ],
        },
        {  # a hub row's Image values: the bytes win over the hub's file name, which is not here
            **row,
            "num_turns": 2,
            "images": [
                {"path": "pics/b.jpg", "bytes": None},
                {"bytes": base64.b64encode(png).decode(), "path": "hub-name.png"},
            ],
            "conversation": [
                [{"role": "user", "content": "<image>\nCompare them."}],
                [{"role": "assistant", "content": "two pictures"}],
                [{"role": "user", "content": "And now?"}],
                [{"role": "assistant", "content": "still two of them"}],
            ],
        },
        {  # flat turns, no answer, base64 wrapped at 76 columns
            "images": [{"bytes": base64.encodebytes(jpeg).decode()}],
            "conversation": [{"role": "user", "content": "Read the sign."}],
        },
        {"prompt": "plain", "images": [{"bytes": base64.b64encode(png).decode()}]},
    ]
    path = tmp_path / "arena.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    reqs = load_dataset(str(path), 4)
    assert [r.prompt for r in reqs] == ["What is this?", "Compare them.", "Read the sign.", "plain"]
    assert [len(r.images) for r in reqs] == [1, 2, 1, 1]
    assert [r.image_sizes for r in reqs] == [
        ((40, 30),),
        ((32, 24), (24, 20)),
        ((50, 18),),
        ((24, 20),),
    ]
    assert [[im.size for im in r.read_images()] for r in reqs] == [
        list(r.image_sizes) for r in reqs
    ]
    assert [r.output_len for r in reqs] == [3, 2, None, None]  # the first answer's words
    assert reqs[0].images == (tmp_path / "pics" / "a.png",)
    assert reqs[1].images[0] == tmp_path / "pics" / "b.jpg"
    # embedded pictures keep their own bytes, and one picture on two lines is one file
    assert reqs[1].images[1].read_bytes() == png and reqs[2].images[0].read_bytes() == jpeg
    assert reqs[3].images[0] == reqs[1].images[1] and tmp_path not in reqs[1].images[1].parents
    sent = dataset_requests(reqs, None, 128)
    assert sent[2].image_uris[0] == "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    assert [r.output_len for r in sent] == [3, 2, 128, 128]
    assert load_dataset(str(path), 1, count_tokens=lambda text: 9)[0].output_len == 9


_ARENA_Q = '{"conversation": [[{"role": "user", "content": "q"}]]'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not JSON"),
        ('["a"]', "line 2: expected a JSON object"),
        (
            '{"text": "x"}',
            "line 2: fits no layout: needs a 'prompt' field (plain), a 'conversations'",
        ),
        ('{"prompt": 3}', "line 2: field 'prompt' must be a string"),
        ('{"prompt": "x", "images": "a.png"}', "line 2: field 'images' must be a list"),
        ('{"prompt": "x", "images": ["gone.png"]}', "line 2: field 'images'[0]: no picture file"),
        ('{"prompt": "x", "images": ["notes.txt"]}', "'images'[0]: "),
        ('{"prompt": "x", "output_len": 0}', "line 2: field 'output_len' must be an integer >= 1"),
        ('{"image": "a.png", "conversations": []}', "line 2: field 'conversations' has no human"),
        ('{"image": "nope.jpg", "conversations": [{"from": "human", "value": "q"}]}', "'image'[0]"),
        ('{"conversation": "q"}', "line 2: field 'conversation' must be a list of turns"),
        ('{"conversation": [["q"]]}', "line 2: field 'conversation' must be a list of turns"),
        (
            '{"conversation": [[{"role": "assistant", "content": "a"}]], "images": ["a.png"]}',
            "line 2: field 'conversation' has no user turn with a string 'content'",
        ),
        (_ARENA_Q + ', "images": "a.png"}', "line 2: field 'images' must be a list of pictures"),
        (_ARENA_Q + ', "images": [{"bytes": "not base64!"}]}', "'images'[0]['bytes']: not base64"),
        (
            _ARENA_Q + ', "images": [{"bytes": "aGVsbG8="}]}',  # "hello"
            "line 2: field 'images'[0]['bytes']: the decoded bytes are not a readable picture",
        ),
        (_ARENA_Q + ', "images": [{"bytes": 7}]}', "'images'[0]['bytes']: expected base64 text"),
        (_ARENA_Q + ', "images": [{"path": "gone.png"}]}', "'images'[0]['path']: no picture file"),
        (
            _ARENA_Q + ', "images": ["a.png", {"url": "http://x/a.png"}]}',
            "line 2: field 'images'[1]: expected a file path, {'path': ...} or {'bytes': base64}",
        ),
    ],
)
def test_malformed_dataset_lines_are_refused_naming_line_and_field(tmp_path, line, message):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "notes.txt").write_text("not a picture")
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "fine", "images": ["a.png"]}\n' + line + "\n")
    with pytest.raises(DatasetError, match="line 2") as err:
        load_dataset(str(path), 2)
    assert message in str(err.value) and str(path) in str(err.value)


def test_bench_refuses_a_bad_dataset_or_goodput_spec_before_any_load(tmp_path, capsys):
    (tmp_path / "d.jsonl").write_text('{"prompt": "x", "images": ["missing.png"]}\n')
    args = ["serve", "--url", "http://127.0.0.1:9", "--protocol", "openai"]
    assert main([*args, "--dataset", str(tmp_path / "d.jsonl")]) == 2
    assert "line 1: field 'images'[0]: no picture file" in capsys.readouterr().err
    assert main([*args, "--goodput", "ttft:300", "itl:20"]) == 2
    assert "unknown key 'itl'" in capsys.readouterr().err
    for bad, says in (("ttft=300", "expected KEY:MS"), ("tpot:fast", "tpot needs a number")):
        with pytest.raises(ValueError, match=says):
            parse_goodput([bad])
    with pytest.raises(ValueError, match="e2e must be > 0"):
        parse_goodput(["e2e:0"])
    assert parse_goodput(["ttft:300,tpot:50", "e2e:2000"]) == {
        "ttft": 300.0,
        "tpot": 50.0,
        "e2e": 2000.0,
    }


def test_goodput_counts_the_requests_meeting_every_objective():
    def rec(ttft_s: float, e2e_s: float, tokens: int) -> Record:
        return Record(ok=True, chunk_times=[ttft_s, e2e_s], e2e=e2e_s, output_tokens=tokens)

    # TTFT 100 / 300 / 100 ms; TPOT (e2e - ttft) / (tokens - 1): 100, 100, 900 ms
    records = [rec(0.1, 1.0, 10), rec(0.3, 1.2, 10), rec(0.1, 1.0, 2), Record(error="x")]
    good = summarize(records, 2.0, {"ttft": 200, "tpot": 150})["goodput"]
    assert good["good_requests"] == 1 and good["goodput_requests_per_s"] == 0.5
    assert good["good_fraction"] == pytest.approx(1 / 3)
    assert summarize(records, 2.0, {"e2e": 1100})["goodput"]["good_requests"] == 2
    assert summarize(records, 2.0)["goodput"] is None


@pytest.fixture(scope="module")
def dataset_server(tiny_llava_dir, tmp_path_factory):
    from tests.server.conftest import start_server

    with start_server(tiny_llava_dir, tmp_path_factory.mktemp("bench-dataset-logs")) as handle:
        yield handle


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc", "openai"])
def test_serve_bench_sends_a_dataset_s_pictures_from_disk(
    dataset_server, tiny_llava_dir, tmp_path, protocol
):
    path = _write_dataset(tmp_path)
    url = dataset_server.grpc_url if protocol == "triton-grpc" else dataset_server.http_url
    args = ["serve", "--url", url, "--protocol", protocol, "--model", tiny_llava_dir]
    args += ["--dataset", str(path), "--num-requests", "4", "--request-rates", "inf"]
    args += ["--concurrency", "2", "--goodput", "ttft:600000", "e2e:600000", "tpot:600000"]
    args += ["--out", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "b.md")]
    assert main(args) == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["errors"] == [] and result["labels"]["server"] == "mmserve"
    work = result["workload"]
    assert (work["source"], work["distinct_lines"], work["cycled"]) == ("dataset", 3, True)
    for row in result["results"]["rate_sweep"] + result["results"]["concurrency_sweep"]:
        m = row["server"]
        # output lengths: line 1 says 3, line 2's answer has 4 tokens by the checkpoint's tokenizer (checked
        # below), line 3 none (the default 128); the 4th request is line 1 again
        assert (m["completed"], m["failed"]) == (4, 0), m["errors"]
        assert m["output_tokens"] == 3 + work_tokens(tiny_llava_dir) + 128 + 3
        assert m["goodput"]["good_requests"] == 4 and m["goodput"]["good_fraction"] == 1.0
    md = (tmp_path / "b.md").read_text()
    assert "its 3 lines cycled" in md and "| point | engine | good requests |" in md


def work_tokens(model_dir: str) -> int:
    from transformers import AutoTokenizer

    return len(
        AutoTokenizer.from_pretrained(model_dir)(
            "a grey square", add_special_tokens=False
        ).input_ids
    )


def test_serve_bench_labels_the_server_column_and_an_unmet_objective_counts_nothing(
    dataset_server, tmp_path
):
    path = _write_dataset(tmp_path)
    args = ["serve", "--url", dataset_server.http_url, "--protocol", "triton-http"]
    args += ["--dataset", str(path), "--num-requests", "2", "--output-len", "2", "--label", "trt"]
    args += ["--request-rates", "", "--concurrency", "1", "--goodput", "e2e:0.001"]
    out = ["--out", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "b.md")]
    assert main([*args, *out, "--plot-dir", str(tmp_path / "p")]) == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["labels"] == {"server": "trt", "hf": "transformers"}
    (row,) = result["results"]["concurrency_sweep"]
    assert row["server"]["output_tokens"] == 4  # --output-len wins over the lines' own
    assert row["server"]["goodput"]["good_requests"] == 0  # no request ends within a microsecond
    assert result["plots"] and "| concurrency 1 | trt | 2/0 |" in (tmp_path / "b.md").read_text()


def test_throughput_bench_runs_a_dataset_and_reports_goodput(tiny_llava_dir, tmp_path):
    path = _write_dataset(tmp_path)
    args = ["throughput", "--model", tiny_llava_dir, "--device", "cpu", "--baseline", "none"]
    args += ["--dataset", str(path), "--num-requests", "3", "--output-len", "4"]
    args += ["--goodput", "ttft:600000,tpot:600000", "--out", str(tmp_path / "r.json")]
    assert main([*args, "--markdown", str(tmp_path / "b.md")]) == 0
    result = strict_json((tmp_path / "r.json").read_text())
    assert result["errors"] == [] and result["model"]["distinct_lines"] == 3
    m = result["results"]["mmserve"]
    assert m["num_requests"] == 3 and m["output_tokens"] == 12
    assert m["goodput"]["good_requests"] == 3 and m["goodput"]["goodput_requests_per_s"] > 0
    assert "mmserve's goodput (ttft ≤ 600,000 ms" in (tmp_path / "b.md").read_text()
