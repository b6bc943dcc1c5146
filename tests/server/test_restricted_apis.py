"""Triton's endpoint access limits on a real server (`--http-restricted-api`, `--grpc-restricted-protocol`):
restricted groups answer Triton's 403 / UNAVAILABLE naming the header until the request carries it, OpenAI routes
follow the same groups, unrestricted groups stay open, and the server keeps serving. Bad specs stop `serve` before
the model loads."""

from __future__ import annotations

import queue
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mmserve.entrypoints.restricted_apis import http_category, parse_restrictions
from tests.server.conftest import start_server
from tests.server.test_triton_grpc import inputs

KEY, SECRET = "mm-key", "s3cret"  # the gRPC inference group's
BEARER = {
    "Authorization": "Bearer tok"
}  # the HTTP inference group's: what an OpenAI client sends as its key
ADMIN = {"admin-key": "adm"}
GENERATE = {"text_input": "USER:\nhello ASSISTANT:", "max_tokens": 4}


@pytest.fixture(scope="module")
def restricted(tiny_llava_dir, tmp_path_factory):
    with start_server(
        tiny_llava_dir,
        tmp_path_factory.mktemp("restricted-logs"),
        "--http-restricted-api",
        "inference:Authorization=Bearer tok",
        "--http-restricted-api",
        "model-config,model-repository:admin-key=adm",
        "--grpc-restricted-protocol",
        f"inference,metadata:{KEY}={SECRET}",
    ) as handle:
        yield handle


def test_http_inference_needs_the_header_and_other_groups_stay_open(restricted):
    url = restricted.http_url
    origin = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    assert (
        "access-control-allow-origin"
        not in httpx.options(f"{url}/v1/models", headers=origin).headers
    )
    refused = httpx.post(f"{url}/v2/models/ensemble/generate", json=GENERATE)
    assert refused.status_code == 403
    assert refused.json() == {"error": "This API is restricted, expecting header 'authorization'"}
    wrong = httpx.post(
        f"{url}/v2/models/ensemble/generate", json=GENERATE, headers={"Authorization": "Bearer x"}
    )
    assert wrong.status_code == 403
    ok = httpx.post(f"{url}/v2/models/ensemble/generate", json=GENERATE, headers=BEARER)
    assert ok.status_code == 200 and ok.json()["text_output"]
    stream = httpx.post(
        f"{url}/v2/models/ensemble/generate_stream",
        json=GENERATE,
        headers={"AUTHORIZATION": "Bearer tok"},
    )  # header names are case-insensitive
    assert stream.status_code == 200 and stream.text.startswith("data: ")
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    assert (
        httpx.get(f"{url}/v2/models/ensemble").status_code == 200
    )  # metadata: not restricted over HTTP
    assert httpx.get(f"{url}/v2/models/ensemble/config").status_code == 403
    assert httpx.get(f"{url}/v2/models/ensemble/config", headers=ADMIN).status_code == 200
    assert httpx.post(f"{url}/v2/repository/index", headers=ADMIN).status_code == 200
    assert httpx.post(f"{url}/v2/repository/index").status_code == 403


def test_an_openai_client_key_opens_the_openai_routes(restricted):
    refused = httpx.post(
        f"{restricted.http_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
    )
    assert refused.status_code == 403
    assert "expecting header 'authorization'" in refused.json()["error"]["message"]
    name = httpx.get(f"{restricted.http_url}/v1/models").json()["data"][0]["id"]  # metadata: open
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(
            base_url=f"{restricted.http_url}/v1", api_key="wrong", max_retries=0
        ).completions.create(model=name, prompt="hi", max_tokens=2)
    client = openai.OpenAI(base_url=f"{restricted.http_url}/v1", api_key="tok", max_retries=0)
    assert (
        client.completions.create(model=name, prompt="hi", max_tokens=2).usage.completion_tokens
        == 2
    )


def _request() -> list:
    return inputs(
        text_input=np.array([[GENERATE["text_input"].encode()]], dtype=object),
        max_tokens=np.array([[4]], np.int32),
    )


def test_grpc_calls_need_the_prefixed_metadata(restricted):
    header = {f"triton-grpc-protocol-{KEY}": SECRET}
    with grpcclient.InferenceServerClient(restricted.grpc_url) as client:
        assert client.is_server_live() and client.is_model_ready("ensemble")  # health: open
        for call in (
            lambda **kw: client.infer("ensemble", _request(), **kw),
            lambda **kw: client.get_model_metadata("ensemble", **kw),
        ):
            with pytest.raises(InferenceServerException) as err:
                call()
            assert (
                f"This protocol is restricted, expecting header 'triton-grpc-protocol-{KEY}'"
                in str(err.value)
            )
            assert "UNAVAILABLE" in str(err.value.status())
        text = client.infer("ensemble", _request(), headers=header).as_numpy("text_output")[0]
        assert text.decode().startswith("USER:")
        assert client.get_model_metadata("ensemble", headers=header).name == "ensemble"
        assert (
            client.get_model_config("ensemble").config.name == "ensemble"
        )  # model-config: open over gRPC
    refused = _stream(
        restricted.grpc_url, None
    )  # the decoupled stream: its metadata come at its start
    assert len(refused) == 1 and "This protocol is restricted" in str(refused[0][1])
    answered = _stream(restricted.grpc_url, header)
    assert answered and all(error is None for _, error in answered)
    assert answered[-1][0].get_response().parameters["triton_final_response"].bool_param


def _stream(url: str, headers: dict | None) -> list[tuple]:
    """One request on a ModelStreamInfer stream opened with `headers`: its (result, error) callbacks."""
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(
            callback=lambda result, error: results.put((result, error)), headers=headers
        )
        client.async_stream_infer("ensemble", _request(), request_id="s")
        client.stop_stream()
    return [results.get() for _ in range(results.qsize())]


def test_specs_are_parsed_as_triton_parses_them():
    got = parse_restrictions(
        ["inference,health:My-Key=a=b", "metadata:k=v"], "--opt", "triton-grpc-protocol-"
    )
    assert (
        got["inference"].header == "triton-grpc-protocol-my-key" and got["inference"].value == "a=b"
    )
    assert got["health"] == got["inference"] and got["metadata"].value == "v"
    for spec, needle in [
        ("bogus:k=v", "unknown API 'bogus'"),
        ("inference", "APIS:KEY=VALUE"),
        ("inference:k", "APIS:KEY=VALUE"),
        (":k=v", "APIS:KEY=VALUE"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_restrictions([spec], "--opt")
    with pytest.raises(ValueError, match="'inference' can not be in more than one group"):
        parse_restrictions(["inference:a=1", "health,inference:b=2"], "--opt")
    table = {
        ("POST", "/v2/models/ensemble/infer"): "inference",
        ("POST", "/v2/models/ensemble/versions/1/generate_stream"): "inference",
        ("POST", "/v1/chat/completions"): "inference",
        ("POST", "/tokenize"): "inference",
        ("GET", "/v2/models/ensemble/ready"): "health",
        ("GET", "/health"): "health",
        ("GET", "/v2/models/ensemble/versions/1/config"): "model-config",
        ("GET", "/v2"): "metadata",
        ("GET", "/v1/models/x"): "metadata",
        ("POST", "/v2/repository/index"): "model-repository",
        ("GET", "/metrics"): "statistics",
        ("GET", "/v2/models/stats"): "statistics",
        ("GET", "/v2/models/ensemble/versions/1/stats"): "statistics",
        ("GET", "/v2/models/ensemble/generate"): None,
        ("GET", "/docs"): None,
    }
    assert {k: http_category(*k) for k in table} == table


def test_a_bad_spec_stops_serve_before_the_model_loads(tiny_llava_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmserve.entrypoints.cli",
            "serve",
            tiny_llava_dir,
            "--device",
            "cpu",
            "--grpc-restricted-protocol",
            "inference:k=v",
            "--grpc-restricted-protocol",
            "inference:j=w",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert (
        "--grpc-restricted-protocol: API 'inference' can not be in more than one group"
        in proc.stderr
    )


@pytest.mark.parametrize("protocol", ["triton-http", "triton-grpc", "openai"])
def test_the_serve_bench_sends_headers_and_keeps_no_secret(restricted, tmp_path, protocol):
    """`mmserve bench serve --header KEY=VALUE` reaches a restricted server over each protocol; its results files
    name the header but not its value. Without it every request fails with the server's refusal."""
    import json

    from mmserve.bench.cli import main

    url = restricted.grpc_url if protocol == "triton-grpc" else restricted.http_url
    header = (
        f"triton-grpc-protocol-{KEY}={SECRET}"
        if protocol == "triton-grpc"
        else "Authorization=Bearer tok"
    )
    secret = SECRET if protocol == "triton-grpc" else "Bearer tok"
    common = [
        "serve",
        "--url",
        url,
        "--protocol",
        protocol,
        "--device",
        "cpu",
        "--request-rates",
        "inf",
        "--concurrency",
        "",
        "--num-requests",
        "2",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--warmup",
        "0",
    ]
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert main([*common, "--header", header, "--out", str(out), "--markdown", str(md)]) == 0
    row = json.loads(out.read_text())["results"]["rate_sweep"][0]["server"]
    assert (row["completed"], row["failed"]) == (2, 0), row["errors"]
    assert secret not in out.read_text() and secret not in md.read_text()
    assert "<redacted>" in out.read_text()
    assert main([*common, "--out", str(tmp_path / "x.json")]) == 0
    refused = json.loads((tmp_path / "x.json").read_text())["results"]["rate_sweep"][0]["server"]
    assert refused["failed"] == 2 and "restricted" in str(refused["errors"])


def test_api_key_puts_inference_and_metadata_behind_a_bearer_token(
    tiny_llava_dir, tmp_path_factory, monkeypatch
):
    """`--api-key` (here from $MMSERVE_API_KEY) is the OpenAI-style key over both protocols; health stays open."""
    monkeypatch.setenv("MMSERVE_API_KEY", "s3cret")
    logs = tmp_path_factory.mktemp("api-key-logs")
    with start_server(tiny_llava_dir, logs, "--allowed-origins", "https://app.example") as handle:
        url = handle.http_url
        assert httpx.get(f"{url}/v2/health/ready").status_code == 200
        # CORS: a browser's preflight carries no key; the page's request then gets the origin back
        cors = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        preflight = httpx.options(f"{url}/v1/completions", headers=cors)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            f"{url}/v1/completions", headers={**cors, "Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
        assert httpx.get(f"{url}/v1/models").status_code == 403
        assert httpx.post(f"{url}/v2/models/ensemble/generate", json=GENERATE).status_code == 403
        bearer = {"Authorization": "Bearer s3cret"}
        name = httpx.get(f"{url}/v1/models", headers=bearer).json()["data"][0]["id"]
        with pytest.raises(openai.PermissionDeniedError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        done = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert done.usage.completion_tokens == 2
        page = httpx.get(f"{url}/v1/models", headers={**bearer, "Origin": "https://app.example"})
        assert page.headers["access-control-allow-origin"] == "https://app.example"
        with grpcclient.InferenceServerClient(handle.grpc_url) as grpc_client:
            assert grpc_client.is_server_ready()
            with pytest.raises(InferenceServerException, match="This protocol is restricted"):
                grpc_client.infer("ensemble", _request())
            header = {"triton-grpc-protocol-authorization": "Bearer s3cret"}
            text = grpc_client.infer("ensemble", _request(), headers=header).as_numpy("text_output")
            assert text[0].decode().startswith("USER:")
        assert "s3cret" not in handle.log()


def test_api_key_and_a_restriction_of_the_same_group_conflict():
    from mmserve.entrypoints.server_config import ServerConfig

    with pytest.raises(
        ValueError, match=r"with --api-key.*'inference' can not be in more than one"
    ):
        ServerConfig(api_key="k", http_restricted_api=("inference:x=y",))
    assert "zebra" not in repr(ServerConfig(api_key="zebra"))  # logs and tracebacks keep no secret
