"""Checks that a response is well formed on the wire, for the soak and fuzz suites (and any client test).

Each check takes what a client received and returns the problems found, as sentences (empty: well
formed), so a run can collect every problem instead of stopping at the first. `complete=False` is for a
stream the client closed early: what arrived must be a well-formed prefix, nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from core.testing.parse import parse_sse

ANTHROPIC_ROUTES = "/v1/messages"


def json_or_none(data: str) -> Any:
    """`data` parsed as JSON, or None when it is not JSON."""
    try:
        return json.loads(data)
    except ValueError:
        return None


def check_error_body(path: str, status: int, body: bytes) -> list[str]:
    """A 4xx/5xx body must be JSON in the route's protocol shape: Anthropic's `{"type": "error", "error":
    {type, message}}` under /v1/messages, OpenAI's `{"error": {message, type, param, code}}` elsewhere."""
    parsed = json_or_none(body.decode("utf-8", errors="replace"))
    where = f"{status} on {path}"
    if not isinstance(parsed, dict):
        return [f"{where}: the error body is not a JSON object: {body[:200]!r}"]
    error = parsed.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return [f"{where}: no error.message: {parsed!r:.200}"]
    if path.startswith(ANTHROPIC_ROUTES):
        if parsed.get("type") != "error" or set(error) != {"type", "message"}:
            return [f"{where}: not Anthropic's error shape: {parsed!r:.200}"]
    elif set(error) < {"message", "type", "param", "code"}:
        return [f"{where}: not OpenAI's error shape: {parsed!r:.200}"]
    if "Traceback" in error["message"]:
        return [f"{where}: the error message leaks a traceback"]
    return []


def openai_stream_texts(text: str) -> dict[int, str]:
    """The text of each choice of an OpenAI stream (chat deltas or completion texts)."""
    texts: dict[int, str] = {}
    for _, data in parse_sse(text):
        chunk = json_or_none(data)
        for choice in chunk.get("choices", ()) if isinstance(chunk, dict) else ():
            piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def check_openai_stream(text: str, choices: int, *, complete: bool = True) -> list[str]:
    """An OpenAI SSE stream: JSON chunks, each choice index in range, one finish_reason per choice and
    nothing for a choice after it, no error event, and `data: [DONE]` last (a complete stream has all
    of it)."""
    problems: list[str] = []
    finished: dict[int, str] = {}
    events = parse_sse(text)
    done_at = next((i for i, (_, data) in enumerate(events) if data == "[DONE]"), None)
    if done_at is not None and done_at != len(events) - 1:
        problems.append("events after [DONE]")
    for _, data in events[:done_at]:
        chunk = json_or_none(data)
        if not isinstance(chunk, dict) or "error" in chunk:
            problems.append(f"not a chunk: {data[:200]}")
            continue
        for choice in chunk.get("choices", ()):
            problems += _check_choice_chunk(choice, choices, finished)
    if complete:
        if done_at is None:
            problems.append("no [DONE]")
        missing = sorted(set(range(choices)) - set(finished))
        if missing:
            problems.append(f"choices {missing} have no finish_reason")
    return problems


def _check_choice_chunk(choice: dict[str, Any], choices: int, finished: dict[int, str]) -> list[str]:
    index = choice.get("index")
    if not isinstance(index, int) or not 0 <= index < choices:
        return [f"choice index {index!r} outside [0, {choices})"]
    problems = []
    if index in finished:
        problems.append(f"choice {index} has output after its finish_reason {finished[index]!r}")
    if choice.get("finish_reason") is not None:
        finished[index] = choice["finish_reason"]
    return problems


ANTHROPIC_BLOCK_EVENTS = ("content_block_start", "content_block_delta", "content_block_stop")


def check_anthropic_stream(text: str, *, complete: bool = True) -> list[str]:
    """An Anthropic SSE stream: message_start first; content blocks opened, filled and closed one at a
    time with consecutive indices; one message_delta with a stop_reason; message_stop last; no error."""
    problems: list[str] = []
    events = [(name, json_or_none(data)) for name, data in parse_sse(text)]
    names = [name for name, _ in events]
    if names and names[0] != "message_start":
        problems.append(f"the first event is {names[0]!r}, not message_start")
    if "error" in names:
        problems.append(f"an error event: {events[names.index('error')][1]!r:.200}")
    problems += _check_blocks(events)
    if "message_stop" in names and names.index("message_stop") != len(names) - 1:
        problems.append("events after message_stop")
    deltas = [payload for name, payload in events if name == "message_delta"]
    if len(deltas) > 1:
        problems.append(f"{len(deltas)} message_delta events")
    if complete:
        if not deltas or not (deltas[0].get("delta") or {}).get("stop_reason"):
            problems.append("no message_delta with a stop_reason")
        if "message_stop" not in names:
            problems.append("no message_stop")
    return problems


def _check_blocks(events: Iterable[tuple[str | None, Any]]) -> list[str]:
    open_index: int | None = None
    next_index = 0
    for name, payload in events:
        if name not in ANTHROPIC_BLOCK_EVENTS:
            if name in ("message_delta", "message_stop") and open_index is not None:
                return [f"{name} while block {open_index} is open"]
            continue
        index = payload.get("index") if isinstance(payload, dict) else None
        if name == "content_block_start":
            if open_index is not None or index != next_index:
                return [f"block {index} started while {open_index} open (expected {next_index})"]
            open_index, next_index = index, next_index + 1
        elif index != open_index:
            return [f"{name} for block {index}, but the open block is {open_index}"]
        elif name == "content_block_stop":
            open_index = None
    return []


def anthropic_stream_text(text: str) -> str:
    """The text of an Anthropic stream's text blocks."""
    pieces = []
    for name, data in parse_sse(text):
        payload = json_or_none(data)
        if name == "content_block_delta" and isinstance(payload, dict):
            pieces.append((payload.get("delta") or {}).get("text") or "")
    return "".join(pieces)


def check_openai_body(body: Any, choices: int) -> list[str]:
    """A whole chat.completion / text_completion: `choices` choices, indices 0..choices-1, each with a
    finish_reason."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return [f"not a completion object: {body!r:.200}"]
    indices = sorted(c.get("index") for c in body["choices"])
    if indices != list(range(choices)):
        return [f"choice indices {indices}, expected 0..{choices - 1}"]
    return [f"choice {c['index']} has no finish_reason" for c in body["choices"] if not c.get("finish_reason")]


def check_anthropic_body(body: Any) -> list[str]:
    """A whole Anthropic message: type message, a content list, a stop_reason."""
    if not isinstance(body, dict) or body.get("type") != "message" or not isinstance(body.get("content"), list):
        return [f"not a message: {body!r:.200}"]
    return [] if body.get("stop_reason") else ["the message has no stop_reason"]


def check_stream(path: str, text: str) -> list[str]:
    """A complete stream of `path` in its protocol, the number of choices taken from what arrived."""
    if path.startswith(ANTHROPIC_ROUTES):
        return check_anthropic_stream(text)
    indices = {index for index in openai_stream_texts(text)}
    return check_openai_stream(text, max(indices, default=-1) + 1)


def check_response(path: str, status: int, content_type: str, body: bytes) -> list[str]:
    """Any response of the server: no 5xx but a 503, every error a JSON body in the route's protocol,
    every stream well formed, every other 200 JSON (or the Prometheus text of /metrics)."""
    problems = [f"{status} on {path}: {body[:300]!r}"] if status >= 500 and status != 503 else []
    if status >= 400:
        return problems + check_error_body(path, status, body)
    if content_type.startswith("text/event-stream"):
        return check_stream(path, body.decode("utf-8", errors="replace"))
    if content_type.startswith("application/json") and json_or_none(body.decode("utf-8", "replace")) is None:
        return [f"{status} on {path}: the body is not JSON: {body[:200]!r}"]
    return problems
