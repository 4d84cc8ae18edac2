"""core.channel: items handed from a producer thread to consumers on an event loop, one by one or batched."""

from __future__ import annotations

import asyncio
import threading

import pytest

from core.channel import LoopChannel, batched_sends


class LoopThread:
    """An event loop running in its own thread (as the server's), counting its thread-safe wake-ups."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wakeups = 0
        plain = self.loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            self.wakeups += 1
            return plain(*args, **kwargs)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def channel(self) -> LoopChannel:
        return LoopChannel(self.loop)

    def read(self, channel: LoopChannel, timeout: float = 5) -> list:
        async def items() -> list:
            return [item async for item in channel]

        return asyncio.run_coroutine_threadsafe(items(), self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def loop_thread():
    running = LoopThread()
    yield running
    running.stop()


def test_each_send_outside_a_batch_wakes_the_loop(loop_thread):
    channel = loop_thread.channel()
    for item in (1, 2):
        channel.send(item)
    channel.close()
    assert loop_thread.wakeups == 3
    assert loop_thread.read(channel) == [1, 2]


def test_a_batch_wakes_each_loop_once_and_keeps_each_channels_order(loop_thread):
    channels = [loop_thread.channel() for _ in range(32)]
    with batched_sends():
        for step in range(3):
            for channel in channels:
                channel.send(step)
        for channel in channels:
            channel.close()
        assert loop_thread.wakeups == 0  # nothing handed over before the block ends
    assert loop_thread.wakeups == 1
    assert all(loop_thread.read(channel) == [0, 1, 2] for channel in channels)


def test_a_batch_reaches_every_loop_it_sent_to():
    first, second = LoopThread(), LoopThread()
    try:
        a, b = first.channel(), second.channel()
        with batched_sends():
            a.send("a")
            b.send("b")
            a.close()
            b.close()
        assert (first.wakeups, second.wakeups) == (1, 1)
        assert first.read(a) == ["a"] and second.read(b) == ["b"]
    finally:
        first.stop()
        second.stop()


def test_a_batch_ended_by_an_exception_still_delivers(loop_thread):
    channel = loop_thread.channel()
    with pytest.raises(RuntimeError, match="step failed"):
        with batched_sends():
            channel.send(ValueError("bad request"))
            channel.close()
            raise RuntimeError("step failed")
    with pytest.raises(ValueError, match="bad request"):
        loop_thread.read(channel)


def test_a_nested_batch_belongs_to_the_outer_one(loop_thread):
    channel = loop_thread.channel()
    with batched_sends():
        with batched_sends():
            channel.send(1)
        assert loop_thread.wakeups == 0
        channel.send(2)
        channel.close()
    assert loop_thread.wakeups == 1
    assert loop_thread.read(channel) == [1, 2]


def test_a_batch_is_per_thread(loop_thread):
    """Another thread's sends, while this thread holds a batch open, go out at once."""
    mine, theirs = loop_thread.channel(), loop_thread.channel()
    with batched_sends():
        mine.send("mine")
        sender = threading.Thread(target=lambda: (theirs.send("theirs"), theirs.close()))
        sender.start()
        sender.join(5)
        assert loop_thread.wakeups == 2
        mine.close()
    assert loop_thread.read(theirs) == ["theirs"] and loop_thread.read(mine) == ["mine"]


def test_sending_to_a_closed_loop_is_a_no_op():
    loop = asyncio.new_event_loop()
    loop.close()
    channel = LoopChannel(loop)
    channel.send(1)
    with batched_sends():
        channel.send(2)
        channel.close()
