"""Handing a stream of items from one thread to another, one protocol both ways.

A producer calls `send(item)` for each item, `send(exception)` to fail the stream (the consumer raises
it) and `close()` at the end. `LoopChannel` delivers to a consumer on an asyncio loop from any thread
(the pytorch backend's engine thread to a request's event loop); `ThreadChannel` delivers to a blocking
consumer (the Pipeline's event-loop thread to the caller's thread). No torch, no asyncio policy: plain
queues.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator
from typing import Any

_END = object()


def _item(value: Any) -> Any:
    if isinstance(value, BaseException):
        raise value
    return value


class LoopChannel:
    """Items for a consumer on `loop`, sent from any thread; iterate it (async) on that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.closed = False  # the consumer has read the end of the stream

    def send(self, item: Any) -> None:
        """Deliver `item` (an exception: the consumer raises it); a no-op once `loop` is closed."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass

    def close(self) -> None:
        """End the stream after the items sent so far."""
        self.send(_END)

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (value := await self._queue.get()) is not _END:
            yield _item(value)
        self.closed = True


class ThreadChannel:
    """Items for a blocking consumer thread, sent from any thread; iterate it on the consumer's."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()

    def send(self, item: Any) -> None:
        """Deliver `item` (an exception: the consumer raises it)."""
        self._queue.put(item)

    def close(self) -> None:
        """End the stream after the items sent so far."""
        self._queue.put(_END)

    def __iter__(self) -> Iterator[Any]:
        while (value := self._queue.get()) is not _END:
            yield _item(value)

    def wait_closed(self, timeout: float) -> None:
        """Discard items until the producer closes the channel (its cleanup has run)."""
        while self._queue.get(timeout=timeout) is not _END:
            pass
