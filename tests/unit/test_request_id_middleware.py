"""RequestIds (ASGI middleware) and engine_request_id: the engine requests of one HTTP request are named after its
id, in order, and the id is reset after the request."""

from __future__ import annotations

import asyncio

from mmserve.entrypoints.request_ids import RequestIds, current_request_id, engine_request_id


def _call(headers: list[tuple[bytes, bytes]]) -> tuple[list[str], dict[bytes, bytes]]:
    seen: list[str] = []
    sent: dict[bytes, bytes] = {}

    async def app(scope, receive, send) -> None:
        seen.extend(engine_request_id() for _ in range(3))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def send(message) -> None:
        if message["type"] == "http.response.start":
            sent.update(message["headers"])

    scope = {"type": "http", "headers": headers}
    asyncio.run(RequestIds(app)(scope, None, send))
    return seen, sent


def test_engine_requests_are_named_after_the_http_request():
    seen, sent = _call([(b"x-request-id", b"abc")])
    assert seen == ["abc", "abc-1", "abc-2"] and sent[b"x-request-id"] == b"abc"
    assert current_request_id() is None  # reset after the request
    fresh, sent = _call([(b"x-request-id", b"has space")])
    assert fresh[0] == sent[b"x-request-id"].decode() != "has space" and len(fresh[0]) == 32
    assert len(engine_request_id()) == 32  # outside an HTTP request: a fresh uuid
