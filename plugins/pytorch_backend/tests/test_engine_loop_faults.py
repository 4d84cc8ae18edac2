"""The engine loop under faults and bulk control: abort-all in one step, and a request that makes a step
raise fails alone (the step is retried without it)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.errors import BackendError
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=100, ignore_eos=True)


def make_backend(path, **options) -> PytorchBackend:
    return PytorchBackend(EngineConfig(model=str(path), **{"dtype": "float32", "kv_cache_memory_gib": 0.01, **options}))


class Counter:
    """Counts the engine loop's steps (its `_step`, on the loop thread) and commands (`call`)."""

    def __init__(self, loop) -> None:
        self.steps = self.commands = 0
        self._lock = threading.Lock()
        step, call = loop._step, loop.call

        def counted_step() -> None:
            with self._lock:
                self.steps += 1
            step()

        def counted_call(fn):
            self.commands += 1
            return call(fn)

        loop._step, loop.call = counted_step, counted_call


def prompts(count: int) -> list[list[int]]:
    return [[(11 * i + 7 * j + 3) % 250 for j in range(4 + i % 5)] for i in range(count)]


@pytest.fixture
async def engine(tiny_checkpoint_factory):
    engine = AsyncEngine(make_backend(tiny_checkpoint_factory("llama")))
    yield engine
    await engine.close()


async def test_abort_all_of_many_streams_ends_within_one_step(engine):
    counter = Counter(engine.backend.loop)
    streams = [engine.generate(p, GREEDY) for p in prompts(16)]
    await asyncio.gather(*(stream.__anext__() for stream in streams))
    steps, commands = counter.steps, counter.commands
    assert await engine.abort_all() == 16
    assert counter.commands - commands == 1, "one command aborts them all"
    responses = await asyncio.gather(*(collect(stream) for stream in streams))
    assert counter.steps - steps <= 1, f"abort-all took {counter.steps - steps} steps"
    assert {r.finish_reason for r in responses} == {"abort"}
    assert_idle(engine, await wait_idle(engine))


async def _generate_bad_request(backend: PytorchBackend, vocab_size: int) -> list:
    """A request the sampler rejects (a banned stop token outside the vocabulary), sent to the backend
    directly: the engine's own validation would refuse it."""
    from core.backend import GenerateRequest

    request = GenerateRequest("bad", [5, 6, 7], GREEDY.replace(min_new_tokens=5), max_new_tokens=20,
                              stop_token_ids=frozenset({vocab_size + 50}))
    try:
        return [output async for output in backend.generate(request)]
    finally:
        await backend.end("bad")


async def test_a_request_that_fails_its_step_fails_alone(engine):
    config = GREEDY.replace(max_new_tokens=24)
    alone = [(await collect(engine.generate(p, config))).token_ids for p in prompts(6)]
    streams = [engine.generate(p, config) for p in prompts(6)]
    firsts = await asyncio.gather(*(stream.__anext__() for stream in streams))
    bad = asyncio.ensure_future(_generate_bad_request(engine.backend, engine.model_info.vocab_size))
    responses = await asyncio.gather(*(collect(stream) for stream in streams))
    with pytest.raises(BackendError, match="engine step failed"):
        await bad
    for first, response, expected in zip(firsts, responses, alone, strict=True):
        assert response.finish_reason == "length"
        assert first.token_ids + response.token_ids == expected
    assert_idle(engine, await wait_idle(engine))
