"""Operational routes: health, version, sleep/wakeup, abort, tokenize/detokenize, metrics."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from core import __version__
from core.engine import AsyncEngine
from core.errors import InvalidRequestError, RequestNotFoundError
from core.server.openai_protocol import AbortRequest, DetokenizeRequest, TokenizeRequest
from core.server.serving import check_model, parse_body, state_of

log = logging.getLogger(__name__)
router = APIRouter()
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def engine_alive(engine: AsyncEngine) -> bool:
    """False once the engine is shut down or its backend cannot report stats (it died)."""
    if engine.is_closed:
        return False
    try:
        engine.stats()
    except Exception:
        log.exception("the backend failed its health check")
        return False
    return True


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 "ok" (or "sleeping" while asleep); 503 when the engine has died."""
    engine = state_of(request).engine
    if not engine_alive(engine):
        return JSONResponse({"status": "unhealthy"}, status_code=503)
    return JSONResponse({"status": "sleeping" if engine.is_sleeping else "ok"})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus text format."""
    state = state_of(request)
    return PlainTextResponse(state.metrics.render(state.engine.stats(), state.model_name), media_type=PROMETHEUS_TEXT)


# -- sleep -----------------------------------------------------------------------------------------


def parse_level(raw: str | None) -> int:
    """Sleep level from the query string: 1 (default) or 2."""
    if raw is None:
        return 1
    if raw not in ("1", "2"):
        raise InvalidRequestError(f"level must be 1 or 2, got {raw!r}", param="level")
    return int(raw)


@router.post("/sleep")
async def sleep(request: Request) -> dict[str, Any]:
    """Release memory: level 1 drops the KV cache and offloads weights, level 2 drops both.

    Idempotent; a call made while a sleep or wakeup runs waits for it, so the answer always describes
    memory already released (AsyncEngine.sleep).
    """
    engine = state_of(request).engine
    level = parse_level(request.query_params.get("level"))
    await engine.sleep(level)
    return {"is_sleeping": engine.is_sleeping, "asleep": sorted(engine.asleep_tags)}


@router.post("/wakeup")
async def wakeup(request: Request) -> dict[str, Any]:
    """Restore `tags` (weights, kv_cache; none given = all); serving resumes when all are awake. A call
    made while a sleep runs waits for it to finish, then wakes."""
    engine = state_of(request).engine
    tags = request.query_params.getlist("tags") or None
    await engine.wakeup(tags)
    return {"is_sleeping": engine.is_sleeping, "asleep": sorted(engine.asleep_tags)}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": state_of(request).engine.is_sleeping}


@router.post("/abort")
async def abort(request: Request) -> dict[str, Any]:
    """Abort one request by id ({"request_id": ...}; 404 when none is in flight) or all ({"all": true})."""
    engine = state_of(request).engine
    body = await parse_body(request, AbortRequest)
    if body.all:
        return {"aborted": await engine.abort_all()}
    if body.request_id is None:
        raise InvalidRequestError('give "request_id" or "all": true', param="request_id")
    aborted = await engine.abort(body.request_id)
    if not aborted:
        raise RequestNotFoundError(f"no request {body.request_id!r} is in flight (it may have finished)",
                                   param="request_id")
    return {"aborted": aborted}


# -- tokenizer -------------------------------------------------------------------------------------


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """Token ids of a prompt, or of chat messages rendered with the chat template (off the event loop)."""
    state = state_of(request)
    body = await parse_body(request, TokenizeRequest)
    check_model(state, body.model)
    engine = state.engine
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError('give exactly one of "prompt" and "messages"', param="prompt")
    if body.messages is not None:
        tokens = await engine.tokenize_async(body.messages, add_generation_prompt=body.add_generation_prompt,
                                             tools=body.tools, chat_template_kwargs=body.chat_template_kwargs)
    else:
        tokens = await engine.tokenize_async(body.prompt or "", add_special_tokens=body.add_special_tokens)
    return {"count": len(tokens), "max_model_len": engine.model_info.max_model_len, "tokens": tokens}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, str]:
    """Text of token ids."""
    state = state_of(request)
    body = await parse_body(request, DetokenizeRequest)
    check_model(state, body.model)
    vocab = state.engine.model_info.vocab_size
    bad = [t for t in body.tokens if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": state.engine.detokenize(body.tokens)}

