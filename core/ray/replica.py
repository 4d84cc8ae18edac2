"""One replica of the engine on Ray Serve: an `AsyncEngine` and the app `core serve` runs over it.

The class is the deployment's body; Ray Serve wraps it with `@serve.ingress()` (core.ray.deployment),
builds the FastAPI app through `__serve_build_asgi_app__` once the engine exists, routes HTTP requests
to it (streaming included), calls `check_health` periodically and replaces a replica that fails it or
dies. Each response names the replica that answered in `X-Core-Replica` (core.ray.middleware).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from core.config import EngineConfig
from core.engine import AsyncEngine
from core.ray.middleware import BodyDeadlineMiddleware, ReplicaHeaderMiddleware

log = logging.getLogger("core.ray")


class EngineDiedError(RuntimeError):
    """The replica's engine is closed or its backend no longer answers: Ray Serve replaces the replica."""


def current_replica_id() -> str:
    """Ray Serve's unique id of the replica this code runs in."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class EngineReplica:
    """The engine `config` describes, served by `core.server.app.build_app(engine, **app_options)`.

    :param config: the engine every replica builds (the model must be readable on every node).
    :param app_options: keyword arguments of `build_app` (api_key, reasoning_parser, tool_call_parser,
        limits, web_ui).
    """

    def __init__(self, config: EngineConfig, app_options: Mapping[str, Any] | None = None) -> None:
        self.replica_id = current_replica_id()
        self.engine = AsyncEngine.from_config(config)
        self._app_options = dict(app_options or {})
        log.info("replica %s serves %r", self.replica_id, self.engine.model_name)

    def __serve_build_asgi_app__(self) -> Any:
        """The FastAPI app over this replica's engine (Ray Serve calls it once, after `__init__`)."""
        from core.server.app import build_app

        app = build_app(self.engine, **self._app_options)
        app.add_middleware(BodyDeadlineMiddleware)  # inside the error handlers: its 503 is a protocol error
        app.add_middleware(ReplicaHeaderMiddleware, replica_id=self.replica_id)
        return app

    def check_health(self) -> None:
        """Ray Serve's periodic health check: raises when the engine has died, so the replica is replaced."""
        from core.server.admin import engine_alive

        if not engine_alive(self.engine):
            raise EngineDiedError(f"the engine of replica {self.replica_id} has died")

    async def __del__(self) -> None:
        """On a graceful shutdown: abort what is in flight and close the engine."""
        if "engine" in vars(self) and not self.engine.is_closed:  # __init__ may have failed before it
            await self.engine.close()
