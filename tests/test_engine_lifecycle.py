"""Admin transitions under load: sleep and wakeup are serialised, and the reported state is the backend's."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
import pytest

from core.engine import AsyncEngine
from core.errors import BackendError, EngineSleepingError
from core.response import collect
from core.server.app import build_app
from core.testing.contract import assert_idle, wait_idle
from core.testing.fake import FakeBackend


class SlowAbortBackend(FakeBackend):
    """A fake whose batched abort (what a sleep runs first) waits until the test lets it go, and whose
    sleep takes a moment, as a real backend's do under load."""

    def __init__(self) -> None:
        super().__init__(step_delay=0.001)
        self.aborting = asyncio.Event()
        self.release = asyncio.Event()

    async def abort(self, session_id: str) -> None:
        await self.abort_many([session_id])

    async def abort_many(self, session_ids: Sequence[str]) -> None:
        self.aborting.set()
        await self.release.wait()
        await super().abort_many(session_ids)

    async def sleep(self, level: int) -> None:
        await asyncio.sleep(0.02)
        await super().sleep(level)


@pytest.fixture
async def engine():
    engine = AsyncEngine(SlowAbortBackend())
    yield engine
    await engine.close()


async def _sleep_under_load(engine: AsyncEngine) -> tuple[asyncio.Task, asyncio.Task]:
    """A stream in flight, a sleep stuck aborting it; returns (stream's collector, sleep) tasks."""
    stream = engine.generate("hello", max_new_tokens=400)
    await stream.__anext__()
    consumer = asyncio.ensure_future(collect(stream))
    sleeping = asyncio.ensure_future(engine.sleep(1))
    await asyncio.wait_for(engine.backend.aborting.wait(), 5)
    return consumer, sleeping


async def test_wakeup_during_a_sleep_waits_for_it_and_leaves_a_working_engine(engine):
    consumer, sleeping = await _sleep_under_load(engine)
    waking = asyncio.ensure_future(engine.wakeup())
    await asyncio.sleep(0.01)
    assert not waking.done() and engine.is_sleeping
    engine.backend.release.set()
    await asyncio.gather(sleeping, waking)
    assert (await consumer).finish_reason == "abort"
    assert not engine.is_sleeping and not engine.backend.is_sleeping
    assert (await collect(engine.generate("again", max_new_tokens=3))).finish_reason == "length"
    assert_idle(engine, await wait_idle(engine))


async def test_a_second_sleep_answers_only_once_the_memory_is_released(engine):
    consumer, first = await _sleep_under_load(engine)
    transport = httpx.ASGITransport(app=build_app(engine), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        second = asyncio.ensure_future(http.post("/sleep"))
        await asyncio.sleep(0.01)
        assert not second.done(), "the second /sleep answered while the first was still aborting"
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}  # the gate is closed
        engine.backend.release.set()
        response = await second
        assert engine.backend.is_sleeping and response.json() == {"is_sleeping": True,
                                                                  "asleep": ["kv_cache", "weights"]}
        await first
        assert (await http.post("/wakeup")).json() == {"is_sleeping": False, "asleep": []}
    assert (await consumer).finish_reason == "abort"


async def test_the_reported_state_is_the_backends(engine):
    transport = httpx.ASGITransport(app=build_app(engine), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        await engine.backend.sleep(1)  # the backend asleep behind the engine's back
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert (await http.get("/health")).json() == {"status": "sleeping"}
        assert (await http.post("/v1/completions", json={"prompt": "x"})).status_code == 503
        assert (await http.post("/wakeup")).json() == {"is_sleeping": False, "asleep": []}
        assert not engine.backend.is_sleeping
        assert (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status_code == 200


class _SlowEmbeddings(FakeBackend):
    """The fake backend with a pooling model whose embeddings take a while."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        from core.pooling import PoolingConfig

        self.pooling = PoolingConfig(method="mean")
        self.seconds = seconds

    async def embed(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        await asyncio.sleep(self.seconds)
        return [[float(len(prompt)), 1.0] for prompt in prompts]


async def test_a_drain_lets_embeddings_in_flight_finish():
    """A graceful shutdown (``drain``) waits for embeddings in the backend as for generation requests: they
    have no session, and the drain ended at once while one was computing (the server then closed the
    engine under it: a 503 where it had the time to finish)."""
    engine = AsyncEngine(_SlowEmbeddings(0.5))
    embedding = asyncio.create_task(engine.embed([[1, 2, 3]]))
    await asyncio.sleep(0.05)
    assert engine.requests_in_flight == 1
    assert await engine.drain(5.0) == 0
    assert embedding.done() and len(embedding.result()) == 1
    assert engine.requests_in_flight == 0
    await engine.close()


class _SleepAbortsEmbeddings(FakeBackend):
    """A pooling fake whose sleep aborts whatever embeddings reach it while it frees (as the pytorch backend's
    engine loop does) and frees until the test lets it finish."""

    def __init__(self) -> None:
        super().__init__()
        from core.pooling import PoolingConfig

        self.pooling = PoolingConfig(method="mean")
        self.freeing, self.freed = asyncio.Event(), asyncio.Event()

    async def embed(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        if self.freeing.is_set():
            raise BackendError("the embedding request was aborted before its prompt was computed")
        return [[float(len(prompt)), 1.0] for prompt in prompts]

    async def sleep(self, level: int) -> None:
        self.freeing.set()
        await self.freed.wait()
        await super().sleep(level)


async def test_an_embedding_tokenized_while_a_sleep_began_is_a_503():
    """Text inputs are tokenized off the event loop after the gate check: a sleep that began meanwhile (its
    epoch already moved on) aborted the embedding in the backend, and the client got a 500 (found by the
    soak). The gate is checked again before the backend is called: the 503 of a sleeping engine."""
    backend = _SleepAbortsEmbeddings()
    engine = AsyncEngine(backend)
    tokenizing = asyncio.Event()
    off_loop = engine.preparation.off_loop

    async def held_off_loop(function, *args, **kwargs):
        await tokenizing.wait()
        return await off_loop(function, *args, **kwargs)

    engine.preparation.off_loop = held_off_loop
    try:
        embedding = asyncio.ensure_future(engine.embed(["hello"]))
        await asyncio.sleep(0.01)  # past the gate, tokenizing
        sleeping = asyncio.ensure_future(engine.sleep(1))
        await asyncio.wait_for(backend.freeing.wait(), 5)
        tokenizing.set()
        with pytest.raises(EngineSleepingError):
            await asyncio.wait_for(embedding, 5)
        backend.freed.set()
        await sleeping
    finally:
        tokenizing.set()
        backend.freed.set()
        await engine.close()
