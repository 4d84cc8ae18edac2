"""Handing a stream of items from one thread to another, one protocol both ways.

A producer calls `send(item)` for each item, `send(exception)` to fail the stream (the consumer raises
it) and `close()` at the end. `LoopChannel` delivers to a consumer on an asyncio loop from any thread
(the pytorch backend's engine thread to a request's event loop); `ThreadChannel` delivers to a blocking
consumer (the Pipeline's event-loop thread to the caller's thread). No torch, no asyncio policy: plain
queues.

A producer that sends to many channels at once (an engine step's token for each of 32 streams) wraps
the sends in `batched_sends()`: each event loop is then woken once for all of them, not once per item.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

_END = object()
_batch = threading.local()  # .pending: {loop: [(queue, item), ...]} while a batched_sends block is open


@contextlib.contextmanager
def batched_sends() -> Iterator[None]:
    """`LoopChannel.send` on this thread, within the block, queues its items; the end of the block hands
    them to each event loop in one wake-up (one `call_soon_threadsafe` a loop, where each item would take
    one, a system call and a thread switch each). Items reach each channel in the order sent; they are
    delivered also when the block ends by an exception. A nested block belongs to the outer one."""
    if getattr(_batch, "pending", None) is not None:
        yield
        return
    _batch.pending = pending = {}
    try:
        yield
    finally:
        _batch.pending = None
        for loop, items in pending.items():
            _call_on(loop, _put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for target, item in items:
        target.put_nowait(item)


def _call_on(loop: asyncio.AbstractEventLoop, fn: Any, arg: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
        pass


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
        """Deliver `item` (an exception: the consumer raises it); a no-op once `loop` is closed. Within
        `batched_sends()` the item waits for the end of the block."""
        pending = getattr(_batch, "pending", None)
        if pending is not None:
            pending.setdefault(self._loop, []).append((self._queue, item))
        else:
            _call_on(self._loop, self._queue.put_nowait, item)

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
