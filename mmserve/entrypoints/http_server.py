"""The HTTP app: health, metrics, and the Triton/KServe and OpenAI routers, over one ServerState; its pure-ASGI
middlewares (body limits and request counts; the restricted API groups' header check)."""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware

from mmserve.entrypoints.json_wire import WireJSONResponse
from mmserve.entrypoints.openai.responses import edge_error_response
from mmserve.entrypoints.request_ids import RequestIds
from mmserve.entrypoints.request_phases import RequestPhases
from mmserve.entrypoints.restricted_apis import Restriction, http_category
from mmserve.entrypoints.state import ServerState

logger = logging.getLogger(__name__)


class UnexpectedErrors:
    """Pure ASGI middleware, outermost: an exception that escapes a route still ends in a well-formed answer, so
    the client can read it and its keep-alive connection stays usable. Before a response has started: a 500 in the
    API's own error shape; within a started response (streams send their own error events first): the body is
    ended cleanly. The exception is logged and not re-raised (re-raised, uvicorn would drop the connection)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = ended = False

        async def tracking_send(message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            with contextlib.suppress(Exception):  # the client may be gone already
                if not started:
                    message = f"internal error: {type(exc).__name__}: {exc}"
                    await edge_error_response(scope["path"], 500, message, "server_error")(
                        scope, receive, send
                    )
                elif not ended:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})


class LimitsAndCounts:
    """Pure ASGI middleware: 413 for bodies over max_request_bytes, and a count of every response by
    route and status. (Starlette's `@app.middleware("http")` would relay each streamed chunk through an
    extra task and memory stream: a cost per token on every stream.)"""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.config.max_request_bytes
        length = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > limit:
            message = f"request body of {length} bytes exceeds the limit of {limit} bytes"
            await edge_error_response(scope["path"], 413, message)(scope, receive, send)
            self.state.metrics.count_request("unmatched", 413)
            return
        status = 500  # unless the app starts a response

        async def send_and_note_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self.state.metrics.count_request(
                getattr(scope.get("route"), "path", "unmatched"), status
            )


class RestrictedApis:
    """Pure ASGI middleware (streams pass through untouched): a request to a restricted group without its
    header value gets Triton's 403."""

    def __init__(self, app, restrictions: dict[str, Restriction]) -> None:
        self.app = app
        self.restrictions = restrictions

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.restrictions:
            restriction = self.restrictions.get(http_category(scope["method"], scope["path"]))
            if restriction is not None:
                sent = dict(scope["headers"]).get(restriction.header.encode("latin-1"))
                if sent is None or sent.decode("latin-1") != restriction.value:
                    message = f"This API is restricted, expecting header '{restriction.header}'"
                    await edge_error_response(scope["path"], 403, message, "permission_error")(
                        scope, receive, send
                    )
                    return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="mmserve", version="0.1.0", default_response_class=WireJSONResponse)
    app.state.mm = state

    app.add_middleware(RestrictedApis, restrictions=state.config.http_restrictions)
    if (
        state.config.allowed_origins
    ):  # outside the restrictions: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.config.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    app.add_middleware(LimitsAndCounts, state=state)  # refusals are counted too
    app.add_middleware(RequestIds)  # outside the refusals: theirs carry the id too
    app.add_middleware(UnexpectedErrors)  # covers the other middlewares too
    app.add_middleware(
        RequestPhases, metrics=state.metrics
    )  # added last = outermost: the call's whole time

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return WireJSONResponse({"error": "; ".join(parts) or "invalid request"}, status_code=400)

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if state.ready else 503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.engine.dead_error is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _include_frontends(app)
    return app


def _include_frontends(app: FastAPI) -> None:
    from mmserve.entrypoints.openai import api as openai_api
    from mmserve.entrypoints.openai import tokenize as tokenize_api
    from mmserve.entrypoints.triton import http as triton_http

    app.include_router(triton_http.router)
    app.include_router(openai_api.router)
    app.include_router(tokenize_api.router)
