"""The HTTP app: health, metrics, and the Triton/KServe and OpenAI routers, over one ServerState."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mmserve.entrypoints.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="mmserve", version="0.1.0")
    app.state.mm = state

    @app.middleware("http")
    async def limits_and_counts(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.config.max_request_bytes:
            message = f"request body of {length} bytes exceeds the limit of {state.config.max_request_bytes} bytes"
            body = ({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
                    if request.url.path.startswith("/v1/") else {"error": message})
            response = JSONResponse(body, status_code=413)
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        state.metrics.count_request(getattr(route, "path", "unmatched"), response.status_code)
        return response

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return JSONResponse({"error": "; ".join(parts) or "invalid request"}, status_code=400)

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if state.engine.dead_error is None else 503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine.dead_error is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _include_frontends(app)
    return app


def _include_frontends(app: FastAPI) -> None:
    from mmserve.entrypoints import openai_api, triton_http
    app.include_router(triton_http.router)
    app.include_router(openai_api.router)
