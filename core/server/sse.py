"""Server-sent events: the wire format of every streaming route."""

from __future__ import annotations

import json
from typing import Any

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def sse_data(payload: Any) -> str:
    """One `data:` event (OpenAI streams)."""
    return f"data: {_dumps(payload)}\n\n"


def sse_event(event: str, payload: Any) -> str:
    """One named event (Anthropic streams): `event: NAME` then its data."""
    return f"event: {event}\ndata: {_dumps(payload)}\n\n"
