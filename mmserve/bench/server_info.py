"""What `mmserve bench serve` asks the server before its load: the model to name in requests, and the server's
own name for the result's column (`--label` overrides it).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from mmserve.bench.serve_config import ServeConfig

FALLBACK_LABEL = "server"


def _http_client(cfg: ServeConfig) -> Any:
    import httpx

    return httpx.AsyncClient(timeout=30, trust_env=False, headers=cfg.headers)


async def _openai_models(cfg: ServeConfig) -> list[dict[str, Any]]:
    async with _http_client(cfg) as client:
        resp = await client.get(f"{cfg.url}/v1/models")
        resp.raise_for_status()
        return list(resp.json()["data"])


async def resolve_model_name(cfg: ServeConfig) -> str:
    """Triton: `ensemble`; OpenAI: the server's first model, the checkpoint's own name before Triton's."""
    if cfg.protocol != "openai":
        return "ensemble"
    ids = [m["id"] for m in await _openai_models(cfg)]
    from mmserve.entrypoints.state import TRITON_MODEL_NAMES

    own = [i for i in ids if i not in TRITON_MODEL_NAMES]
    return (own or ids)[0]


def _host_port(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"//{url}")
    return parts.netloc or url


async def _asked_label(cfg: ServeConfig) -> str | None:
    if cfg.protocol == "openai":
        owners = [m.get("owned_by") for m in await _openai_models(cfg)]
        return next((o for o in owners if isinstance(o, str) and o), None) or _host_port(cfg.url)
    if cfg.protocol == "triton-http":
        async with _http_client(cfg) as client:
            resp = await client.get(f"{cfg.url}/v2")
            resp.raise_for_status()
            return resp.json().get("name")
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(cfg.url)
    try:
        meta = await client.get_server_metadata(headers=cfg.headers or None, as_json=True)
        return meta.get("name")
    finally:
        await client.close()


async def server_label(cfg: ServeConfig) -> str:
    """The measured server's name: KServe v2 server metadata's `name` (Triton protocols), the models' `owned_by`
    else host:port (OpenAI); "server" when the server does not say."""
    try:
        name = await _asked_label(cfg)
    except Exception:  # noqa: BLE001 - a server without the metadata route still gets measured
        name = None
    return name if isinstance(name, str) and name.strip() else FALLBACK_LABEL
