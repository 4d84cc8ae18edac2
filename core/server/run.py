"""`core serve`: build the engine, log what is served, run uvicorn, shut down cleanly on Ctrl-C (abort)
or SIGTERM (drain), and exit non-zero when the engine dies."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from types import FrameType
from typing import Any

import uvicorn

from core.config import EngineConfig
from core.engine import AsyncEngine
from core.server.admin import engine_alive
from core.server.app import build_app
from core.server.limits import ServerLimits

log = logging.getLogger("core.server")
API_KEY_VARIABLE = "CORE_API_KEY"
GRACEFUL_SHUTDOWN_S = 5
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # how long SIGTERM lets requests in flight finish
WATCHDOG_TICKS = 10  # uvicorn ticks every 0.1 s: check the engine once a second
# uvicorn's HTTP/1.1 implementation, fixed: "auto" takes httptools wherever it is installed (ray[serve] and
# uvicorn[standard] bring it), so a server's parsing of bad requests, and what the tests exercised, would
# depend on the environment. h11 is what `pip install core-serve` has; httptools served no faster (Zen 4 EPYC,
# 2 cores: 64 streams 480 / 481 against 486 / 463 out tok/s, one stream 149 / 144 against 142 / 154)
HTTP_IMPLEMENTATION = "h11"
EXIT_ENGINE_DIED = 1


class _Server(uvicorn.Server):
    """uvicorn with the engine's shutdown: Ctrl-C aborts the requests in flight at once, SIGTERM drains
    them (no new requests; those in flight finish for up to `shutdown_timeout` seconds, then the rest are
    aborted); either way the engine is closed as part of the shutdown. A watchdog stops the server when
    the engine dies (`engine_died`), so the process exits non-zero and a supervisor restarts it.

    Closing the engine here, not after `serve()` returns, matters: uvicorn re-raises the signal it
    captured as `serve()` ends, and asyncio.run answers that by cancelling the main task, which would
    cut the engine's close short (the backend's loop thread would never be stopped).
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._engine = engine
        self._shutdown_timeout = shutdown_timeout
        self._drain = False
        self.engine_died = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._drain = self._drain or sig == signal.SIGTERM
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if counter % WATCHDOG_TICKS == 0 and not self.engine_died and not engine_alive(self._engine):
            log.error("the engine has died; stopping the server")
            self.engine_died = True
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: Any = None) -> None:
        if not self.engine_died:
            await self._stop_requests()
        await super().shutdown(sockets=sockets)
        await _close(self._engine)

    async def _stop_requests(self) -> None:
        if not self._drain:
            await self._engine.abort_all()
            return
        for server in self.servers:
            server.close()  # stop accepting connections
        log.info("draining: waiting up to %g s for %d request(s) in flight", self._shutdown_timeout,
                 self._engine.requests_in_flight)
        aborted = await self._engine.drain(self._shutdown_timeout)
        if aborted:
            log.warning("shutdown timeout: aborted %d request(s) still in flight", aborted)


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


def uvicorn_config(app: Any, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings for `core serve`: `--host` / `--port`, h11, no lifespan or access log."""
    return uvicorn.Config(app, host=args.host, port=args.port, http=HTTP_IMPLEMENTATION, lifespan="off",
                          access_log=False, log_level="debug" if getattr(args, "verbose", False) else "info",
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


async def _serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    engine = AsyncEngine.from_config(engine_config)
    try:
        api_key = getattr(args, "api_key", None) or os.environ.get(API_KEY_VARIABLE) or None
        app = build_app(engine, api_key=api_key, reasoning_parser=getattr(args, "reasoning_parser", None),
                        tool_call_parser=getattr(args, "tool_call_parser", None),
                        limits=ServerLimits.from_args(args), web_ui=not getattr(args, "no_web_ui", False))
        log.info(startup_summary(engine, engine_config, f"http://{args.host}:{args.port}"))
        server = _Server(uvicorn_config(app, args), engine,
                         getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S))
        await server.serve()
        return EXIT_ENGINE_DIED if server.engine_died else 0
    finally:
        await _close(engine)  # when start-up failed (shutdown closes it otherwise)


def serve(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    """Run the server until Ctrl-C or SIGTERM (exit status 0), or until the engine dies (1)."""
    # uvicorn re-raises the signal it handled once it has shut down; SIGTERM's default action would
    # kill the process (status -15) after a clean drain, so it raises KeyboardInterrupt, as Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(_serve(args, engine_config))
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
