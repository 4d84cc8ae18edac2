"""`GET /info`: what this server runs and how busy it is, in one JSON object.

The chat page's status view and its image button read it; scripts may too. The gauges are the ones
/metrics reports (read from the backend per call), so the two never disagree.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from core import __version__
from core.backend import Backend
from core.server.serving import ServerState, state_of

router = APIRouter()


def backend_name(backend: Backend) -> str:
    """The backend's registered name where its class declares one (as run.startup_summary reports it)."""
    return getattr(backend, "name", None) or type(backend).__name__


def server_info(state: ServerState) -> dict[str, Any]:
    """The model, the serving set-up and the current gauges."""
    engine, post = state.engine, state.postprocessors
    model, stats = engine.model_info, engine.stats()
    return {
        "version": __version__,
        "model": state.model_name,
        "model_names": list(state.model_names),
        "architecture": model.architecture,
        "backend": backend_name(engine.backend),
        "dtype": model.dtype,
        "quantization": model.quantization,
        "max_model_len": model.max_model_len,
        "vision": engine.vision is not None,
        "reasoning_parser": post.reasoning is not None,
        "tool_call_parser": post.tools is not None,
        "is_sleeping": engine.is_sleeping,
        "requests": {"running": stats.running, "waiting": stats.waiting,
                     "finished": sum(state.metrics.requests.values())},
        "kv_cache": {"usage": stats.kv_cache_usage, "used_blocks": stats.kv_blocks_used,
                     "total_blocks": stats.kv_blocks_total, "block_size": stats.block_size},
    }


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """The served model (name, architecture, backend, dtype, context window, vision or not), whether
    it sleeps, running and waiting requests and KV-cache usage."""
    return server_info(state_of(request))
