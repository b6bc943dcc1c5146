"""TLS on a real server: HTTPS (`--ssl-certfile/--ssl-keyfile`) and Triton's gRPC TLS options, mutual
(`--grpc-use-ssl-mutual`: clients need a certificate signed by `--grpc-root-cert`), with certificates made for
the test by a throwaway CA; plain-text clients and clients without a certificate are refused; bad TLS options stop
`serve` before the model loads."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from tests.server.conftest import start_server
from tests.server.test_triton_grpc import inputs

GENERATE = {"text_input": "USER:\nhello ASSISTANT:", "max_tokens": 4}


def _issue(
    name: str, issuer_key, issuer_name: x509.Name | None, *, ca: bool = False, server: bool = False
):
    """A fresh EC key and its certificate for `name`, signed by issuer_key (self-signed when issuer_name is None)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
    return key, builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """PEM files: a CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    root = tmp_path_factory.mktemp("pki")
    ca_key, ca_cert = _issue("test CA", None, None, ca=True)
    files = {}
    for name, (key, cert) in {
        "ca": (ca_key, ca_cert),
        "server": _issue("127.0.0.1", ca_key, ca_cert.subject, server=True),
        "client": _issue("client", ca_key, ca_cert.subject),
    }.items():
        (root / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (root / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        files[name] = (str(root / f"{name}.key"), str(root / f"{name}.crt"))
    return files


@pytest.fixture(scope="module")
def tls_server(tiny_llava_dir, tmp_path_factory, pki):
    (skey, scert), (_, ca) = pki["server"], pki["ca"]
    with start_server(
        tiny_llava_dir,
        tmp_path_factory.mktemp("tls-logs"),
        "--ssl-certfile",
        scert,
        "--ssl-keyfile",
        skey,
        "--grpc-use-ssl-mutual",
        "--grpc-server-cert",
        scert,
        "--grpc-server-key",
        skey,
        "--grpc-root-cert",
        ca,
        https_ca=ca,
    ) as handle:
        yield handle


def test_https_serves_triton_and_openai_clients_that_trust_the_ca(tls_server, pki):
    trust = ssl.create_default_context(cafile=pki["ca"][1])
    ok = httpx.post(
        f"{tls_server.http_url}/v2/models/ensemble/generate", json=GENERATE, verify=trust
    )
    assert (
        tls_server.http_url.startswith("https://")
        and ok.status_code == 200
        and ok.json()["text_output"]
    )
    with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
        httpx.post(f"{tls_server.http_url}/v2/models/ensemble/generate", json=GENERATE)
    with pytest.raises(httpx.HTTPError):  # plain text on the TLS port
        httpx.post(
            f"http://127.0.0.1:{tls_server.http_port}/v2/models/ensemble/generate", json=GENERATE
        )
    client = openai.OpenAI(
        base_url=f"{tls_server.http_url}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(verify=trust),
    )
    model = client.models.list().data[0].id
    assert (
        client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens
        == 2
    )


def _request() -> list:
    return inputs(
        text_input=np.array([[GENERATE["text_input"].encode()]], dtype=object),
        max_tokens=np.array([[4]], np.int32),
    )


def test_mutual_tls_grpc_needs_a_client_certificate(tls_server, pki):
    (ckey, ccert), ca = pki["client"], pki["ca"][1]
    with grpcclient.InferenceServerClient(
        tls_server.grpc_url,
        ssl=True,
        root_certificates=ca,
        private_key=ckey,
        certificate_chain=ccert,
    ) as client:
        text = client.infer("ensemble", _request()).as_numpy("text_output")[0].decode()
        assert text.startswith("USER:")
    for kw in ({"ssl": True, "root_certificates": ca}, {}):  # no client certificate; plain text
        with grpcclient.InferenceServerClient(tls_server.grpc_url, **kw) as client:
            with pytest.raises(InferenceServerException):
                client.infer("ensemble", _request(), client_timeout=20)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grpc-use-ssl"], "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
        (["--ssl-certfile", "x.pem"], "--ssl-certfile and --ssl-keyfile go together"),
        (
            ["--ssl-certfile", "/nonexistent.pem", "--ssl-keyfile", "/nonexistent.key"],
            "--ssl-certfile: cannot read",
        ),
    ],
)
def test_bad_tls_options_stop_serve_before_the_model_loads(tiny_llava_dir, args, message):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmserve.entrypoints.cli",
            "serve",
            tiny_llava_dir,
            "--device",
            "cpu",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and message in proc.stderr
