"""A test plugin for `core serve` subprocesses: backend "dying", the pytorch backend whose engine loop
thread dies (a BaseException escapes it) when a request's prompt is exactly DIE_PROMPT.

Loaded with CORE_EXTRA_PLUGINS=dying_backend_plugin (and this folder on PYTHONPATH).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from core import hookimpl
from core.backend import BackendOutput, GenerateRequest
from core.config import EngineConfig

DIE_PROMPT = [101, 102, 103, 104, 105]


class EngineThreadKilled(BaseException):
    """Not an Exception: the engine loop does not catch it, so its thread ends."""


def _die() -> None:
    raise EngineThreadKilled("killed by the test")


def make_dying_backend(config: EngineConfig) -> Any:
    from core_pytorch_backend.backend import PytorchBackend

    class DyingBackend(PytorchBackend):
        def generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
            if list(request.prompt_token_ids) == DIE_PROMPT:
                self.loop._step = _die  # the next step kills the loop thread
            return super().generate(request)

    return DyingBackend(config)


@hookimpl
def core_register_backends(register: Any) -> None:
    register("dying", make_dying_backend, description="pytorch, whose engine thread dies on DIE_PROMPT")
