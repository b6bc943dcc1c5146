"""Async stream plumbing the frontends share: `merge`, several async generators' items as they come."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()  # what _next returns for an exhausted stream


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of several async generators as they come (ties in list order). The first exception is
    raised once the others are closed; closing this generator closes them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    waiting: dict[asyncio.Task, int] = {
        asyncio.ensure_future(_next(s)): i for i, s in enumerate(streams)
    }
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=waiting.__getitem__):
                i = waiting.pop(task)
                item = task.result()
                if item is not _END:
                    yield item
                    waiting[asyncio.ensure_future(_next(streams[i]))] = i
    finally:
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _next(stream: AsyncIterator[T]) -> T | object:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return _END
