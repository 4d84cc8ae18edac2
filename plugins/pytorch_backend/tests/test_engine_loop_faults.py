"""The engine loop under faults and bulk control: abort-all in one step, and a request that makes a step
raise fails alone (the step is retried without it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.errors import BackendError
from core.response import collect
from core.testing.contract import assert_idle, wait_idle
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.layers.attention import attention_layers

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


class PausedStep:
    """Holds the first step of at least `rows` sequences until `release()` (before its forward pass, or before
    its first attention layer), and records the attention layers that complete from then on (on the loop
    thread: hooks on the tiny model's layers)."""

    def __init__(self, backend: PytorchBackend, rows: int = 1, before_forward: bool = False) -> None:
        self.rows, self.loop = rows, backend.loop
        self.started, self._released = threading.Event(), threading.Event()
        self.completed: list[int] = []
        layers = attention_layers(backend.loop.runner.model)
        self.layers = len(layers)
        self._hooks = [layer.register_forward_hook(self._done) for layer in layers]
        if before_forward:
            prepare = self.loop.runner.prepare
            self.loop.runner.prepare = lambda chunks, *args: self._pause(len(chunks)) or prepare(chunks, *args)
        else:
            self._hooks.append(layers[0].register_forward_pre_hook(lambda _, args: self._pause(args[3].num_seqs)))

    def _pause(self, rows: int) -> None:
        if not self.started.is_set() and rows >= self.rows:
            self.started.set()
            self._released.wait(timeout=60)

    def _done(self, module, args, output) -> None:
        if self.started.is_set():
            self.completed.append(module.layer_index)

    async def run(self, action: Callable[[], Awaitable[Any]], commands: int = 1) -> Any:
        """Once the step is held: start `action`, release the step when `commands` commands are queued, and
        return what `action` returns."""
        assert await asyncio.to_thread(self.started.wait, 60), "no step started"
        counter = Counter(self.loop)
        task = asyncio.ensure_future(action())
        while counter.commands < commands and not task.done():
            await asyncio.sleep(0.01)
        self._released.set()
        return await task

    def remove(self) -> None:
        self._released.set()
        for hook in self._hooks:
            hook.remove()
        self.loop.runner.__dict__.pop("prepare", None)


def long_prompts(count: int, offset: int = 0) -> list[list[int]]:
    return [[(13 * i + 5 * j + 1 + offset) % 250 for j in range(40 + 9 * i)] for i in range(count)]


async def greedy(engine: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [(await collect(engine.generate(p, GREEDY.replace(max_new_tokens=8)))).token_ids for p in prompts]


@pytest.mark.parametrize("before_forward", [False, True], ids=["in-forward", "before-forward"])
async def test_a_sleep_stops_the_step_in_flight_before_its_next_layer(engine, before_forward):
    """A sleep under load waited for the step in flight (3-7 s for long prefill chunks on a 2-core CPU): an
    abort queued for every request of the step now stops its forward pass at the next attention layer
    (step_interrupt.py), whether it came during the forward pass or while the step was being built. The
    streams end with "abort", nothing leaks, and serving after the wakeup gives the same tokens."""
    expected = await greedy(engine, long_prompts(3))
    paused = PausedStep(engine.backend, before_forward=before_forward)
    try:
        streams = [asyncio.ensure_future(collect(engine.generate(p, GREEDY))) for p in long_prompts(3)]
        await paused.run(lambda: engine.sleep(1))
        assert paused.completed == [], f"the step ran on through layers {paused.completed}"
        assert {r.finish_reason for r in await asyncio.gather(*streams)} == {"abort"}
    finally:
        paused.remove()
    assert_idle(engine, await wait_idle(engine))
    await engine.wakeup()
    assert await greedy(engine, long_prompts(3)) == expected


async def test_aborts_that_together_cover_the_step_stop_it_and_the_prefix_cache_stays_right(engine):
    """Two clients leaving, each its own abort: together they end every request of the step, which stops.
    The blocks it was filling never join the prefix cache, so the same prompts sent again read no
    half-written KV: they get what a fresh engine gives."""
    prompts = long_prompts(2, offset=100)
    reference = AsyncEngine(make_backend(engine.backend.source))
    try:
        expected = await greedy(reference, prompts)
    finally:
        await reference.close()
    paused = PausedStep(engine.backend, rows=2)
    try:
        sessions = [await engine.prepare(p, GREEDY) for p in prompts]
        streams = [asyncio.ensure_future(collect(engine.generate(s))) for s in sessions]
        aborted = await paused.run(lambda: asyncio.gather(*(engine.abort(s.session.id) for s in sessions)), 2)
        assert aborted == [1, 1] and paused.completed == []
        assert {r.finish_reason for r in await asyncio.gather(*streams)} == {"abort"}
    finally:
        paused.remove()
    assert_idle(engine, await wait_idle(engine))
    assert await greedy(engine, prompts) == expected


async def test_an_abort_of_one_request_of_a_step_lets_the_step_finish(engine):
    """The others' work in the step is kept: only aborts of every request of the step stop it."""
    alone = await greedy(engine, long_prompts(2))
    paused = PausedStep(engine.backend, rows=2)
    try:
        sessions = [await engine.prepare(p, GREEDY.replace(max_new_tokens=8)) for p in long_prompts(2)]
        streams = [asyncio.ensure_future(collect(engine.generate(s))) for s in sessions]
        assert await paused.run(lambda: engine.abort(sessions[0].session.id)) == 1
        first, second = await asyncio.gather(*streams)
    finally:
        paused.remove()
    assert paused.completed[: paused.layers] == list(range(paused.layers))
    assert first.finish_reason == "abort"
    assert second.finish_reason == "length" and second.token_ids == alone[1]
    assert_idle(engine, await wait_idle(engine))
