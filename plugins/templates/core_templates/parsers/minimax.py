"""MiniMax-Text-01 / MiniMax-M1 tool calls: JSON objects, one a line, between ``<tool_calls>`` tags.

    <tool_calls>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    {"name": "get_time", "arguments": {}}
    </tool_calls>

Text before and after the block is content. A block holding anything but complete calls (whitespace
between them aside) is kept as content.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from core.parsers import Tool, ToolCallFormat
from core_templates.parsers.hermes import json_call
from core_templates.parsers.tagged import Call, TaggedToolCallParser


class MiniMaxToolCallParser(TaggedToolCallParser):
    """``<tool_calls>`` blocks of ``{"name": ..., "arguments": {...}}`` objects (as vLLM's minimax parser)."""

    start_tag = "<tool_calls>"
    end_tag = "</tool_calls>"
    call_format = ToolCallFormat("<tool_calls>\n", "\n</tool_calls>")

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while (pos := _skip_space(body, pos)) < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError):
                return None
            call = json_call(obj)
            if call is None:
                return None
            calls.append(call)
        return calls or None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
