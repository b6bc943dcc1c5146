"""The gRPC server's interceptors: `RestrictedProtocols` (Triton's restricted protocol groups: a call without its
group's metadata value ends UNAVAILABLE) and `UnexpectedErrors` (an exception no handler expected ends the call
INTERNAL, naming it, and the channel serves on)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

import grpc

from mmserve.entrypoints.restricted_apis import Restriction, grpc_category

logger = logging.getLogger(__name__)


class RestrictedProtocols(grpc.aio.ServerInterceptor):
    """gRPC: a call to a restricted group without its metadata value ends UNAVAILABLE, as Triton's does."""

    def __init__(self, restrictions: dict[str, Restriction]) -> None:
        self.restrictions = restrictions

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        restriction = self.restrictions.get(grpc_category(details.method))
        handler = await continuation(details)
        if restriction is None or handler is None:
            return handler
        if dict(details.invocation_metadata or ()).get(restriction.header) == restriction.value:
            return handler

        message = f"This protocol is restricted, expecting header '{restriction.header}'"

        async def refuse(_request, context) -> None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        async def refuse_stream(requests, context) -> None:
            # after the client's first message: a stream ended before the client wrote to it reads, on the client,
            # as a failed write (INTERNAL) instead of this status
            async for _ in requests:
                break
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        return _with_behavior(handler, refuse_stream if handler.request_streaming else refuse)


class UnexpectedErrors(grpc.aio.ServerInterceptor):
    """gRPC: an exception that escapes a handler ends its call with INTERNAL and a message naming it (grpc's own
    answer would be UNKNOWN with the exception's repr) and is logged; aborts the handler chose pass through."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return handler

        async def fail(exc: Exception, context) -> None:
            logger.error("gRPC %s failed", details.method, exc_info=exc)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            )

        def unary(behavior):
            async def call(request, context):
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await fail(exc, context)

            return call

        def streaming(
            behavior,
        ):  # an async generator, or a coroutine that writes through the context
            async def call(request, context):
                try:
                    responses = behavior(request, context)
                    if inspect.isawaitable(responses):
                        await responses
                        return
                    async for response in responses:
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await fail(exc, context)

            return call

        behavior = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        return _with_behavior(
            handler, streaming(behavior) if handler.response_streaming else unary(behavior)
        )


def _with_behavior(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    """`handler` (its streaming kind and serializers) running `behavior` instead (the interceptors')."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
