"""The backend contract suite, run against the fake backend (pytorch runs it in its own tests)."""

from __future__ import annotations

import pytest

from core.testing.contract import BackendContractTests
from core.testing.fake import FakeBackend


class TestFakeBackendContract(BackendContractTests):
    @pytest.fixture
    async def backend(self):
        backend = FakeBackend(step_delay=0.001)
        yield backend
        await backend.close()
