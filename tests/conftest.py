"""Shared fixtures for the core's tests: a deterministic fake backend and an engine over it."""

from __future__ import annotations

import pytest

from core.engine import AsyncEngine
from core.testing.fake import FakeBackend


@pytest.fixture
def fake_backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
async def engine(fake_backend: FakeBackend):
    engine = AsyncEngine(fake_backend)
    yield engine
    await engine.close()
