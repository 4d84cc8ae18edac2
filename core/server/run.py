"""`core serve`: build the engine, log what is served, run uvicorn, and shut down cleanly on Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any

import uvicorn

from core.config import EngineConfig
from core.engine import AsyncEngine
from core.server.app import build_app

log = logging.getLogger("core.server")
API_KEY_VARIABLE = "CORE_API_KEY"
GRACEFUL_SHUTDOWN_S = 5


class _Server(uvicorn.Server):
    """uvicorn, but in-flight requests are aborted first on shutdown so open streams end promptly, and
    the engine is closed as part of the shutdown.

    Closing it here, not after `serve()` returns, matters: uvicorn re-raises the Ctrl-C it captured as
    `serve()` ends, and asyncio.run answers that by cancelling the main task, which would cut the
    engine's close short (the backend's loop thread would never be stopped).
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self._engine = engine

    async def shutdown(self, sockets: Any = None) -> None:
        await self._engine.abort_all()
        await super().shutdown(sockets=sockets)
        await _close(self._engine)


async def _close(engine: AsyncEngine) -> None:
    if not engine.is_closed:
        await engine.close()
        log.info("engine closed")


def startup_summary(engine: AsyncEngine, config: EngineConfig, url: str) -> str:
    """One line with the model, backend, dtype, KV capacity and URL."""
    info, stats = engine.model_info, engine.stats()
    backend = config.backend or getattr(engine.backend, "name", None) or type(engine.backend).__name__
    kv = f"{stats.kv_blocks_total} blocks x {stats.block_size} tokens = {stats.kv_blocks_total * stats.block_size} tokens"
    return (f"serving model {engine.model_name!r} ({info.architecture}, context {info.max_model_len}) "
            f"on backend {backend}, dtype {info.dtype}, packed weights {info.quantization}, KV cache {kv}, at {url}")


async def _serve(args: argparse.Namespace, engine_config: EngineConfig) -> None:
    engine = AsyncEngine.from_config(engine_config)
    try:
        api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_VARIABLE) or None
        app = build_app(engine, api_key=api_key, reasoning_parser=getattr(args, "reasoning_parser", None),
                        tool_call_parser=getattr(args, "tool_call_parser", None))
        log.info(startup_summary(engine, engine_config, f"http://{args.host}:{args.port}"))
        config = uvicorn.Config(app, host=args.host, port=args.port, lifespan="off", access_log=False,
                                log_level="debug" if getattr(args, "verbose", False) else "info",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        await _Server(config, engine).serve()
    finally:
        await _close(engine)  # when start-up failed (shutdown closes it otherwise)


def serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """Run the server until Ctrl-C (or SIGTERM); returns the exit status."""
    try:
        asyncio.run(_serve(args, engine_config))
    except KeyboardInterrupt:
        pass
    return 0
