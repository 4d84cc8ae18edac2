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


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) pairs of an SSE body; for tests and clients."""
    events = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if name is not None or data:
            events.append((name, "\n".join(data)))
    return events
