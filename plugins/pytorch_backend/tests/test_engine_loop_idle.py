"""The engine loop going idle: once it has waited IDLE_WAIT_SECONDS with nothing to run after steps, it trims
the C heap (core.memory.trim_heap) once, and not again until more steps have run."""

from __future__ import annotations

import asyncio
import threading

import pytest

from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.response import collect
from core_pytorch_backend import engine_loop
from core_pytorch_backend.backend import PytorchBackend

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
IDLE = 0.05  # the loop's idle wait in these tests


class Trims:
    """Counts the loop's heap trims and the thread they ran on."""

    def __init__(self) -> None:
        self.count = 0
        self.threads: set[str] = set()

    def __call__(self) -> bool:
        self.count += 1
        self.threads.add(threading.current_thread().name)
        return True

    async def settle(self, seconds: float = 10 * IDLE) -> int:
        await asyncio.sleep(seconds)
        return self.count


@pytest.fixture
def trims(monkeypatch) -> Trims:
    counted = Trims()
    monkeypatch.setattr(engine_loop, "trim_heap", counted)
    monkeypatch.setattr(engine_loop, "IDLE_WAIT_SECONDS", IDLE)
    return counted


@pytest.fixture
async def engine(tiny_checkpoint_factory, trims):
    config = EngineConfig(model=str(tiny_checkpoint_factory("llama")), dtype="float32", kv_cache_memory_gib=0.01)
    engine = AsyncEngine(PytorchBackend(config))
    yield engine
    await engine.close()


async def test_an_idle_loop_trims_the_heap_once_after_steps_and_not_before(engine, trims):
    assert await trims.settle() == 0, "no step has run: nothing to hand back"
    response = await collect(engine.generate([5, 6, 7], GREEDY))
    assert len(response.token_ids) == 8
    assert await trims.settle() == 1
    assert trims.threads == {"core-pytorch-engine"}, "the loop trims on its own thread"
    assert await trims.settle() == 1, "idle on: no second trim without steps"
    await collect(engine.generate([8, 9], GREEDY))
    assert await trims.settle() == 2


async def test_a_busy_loop_does_not_trim(engine, trims, monkeypatch):
    """Requests back to back (each sent as the last ends) leave the loop no idle wait to trim in."""
    monkeypatch.setattr(engine_loop, "IDLE_WAIT_SECONDS", 1.0)  # far longer than the gap between two requests
    for _ in range(5):
        await collect(engine.generate([5, 6, 7], GREEDY))
    assert trims.count == 0
    assert await trims.settle(3.0) == 1
