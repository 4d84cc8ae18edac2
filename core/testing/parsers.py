"""Helpers for tests of response parsers (core.parsers); the server never calls them."""

from __future__ import annotations

from collections.abc import Sequence

from core.parsers import ParsedToolCalls, ToolCall, ToolCallDelta


def collect_tool_calls(deltas: Sequence[ToolCallDelta]) -> ParsedToolCalls:
    """Join streamed deltas into the response they describe (what a whole-text parse must equal)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for fragment in (f for d in deltas for f in d.tool_calls):
        call = calls.setdefault(fragment.index, [fragment.id or "", fragment.name or "", ""])
        call[2] += fragment.arguments
    return ParsedToolCalls(content, tuple(ToolCall(*calls[i]) for i in sorted(calls)))
