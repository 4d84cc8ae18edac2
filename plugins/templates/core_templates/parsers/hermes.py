"""Hermes / Qwen2.5 / Qwen3 tool calls: a JSON object per ``<tool_call>...</tool_call>`` block.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from core.parsers import Tool, ToolCallFormat
from core_templates.parsers.common import arguments_json
from core_templates.parsers.tagged import Call, TaggedToolCallParser


class HermesToolCallParser(TaggedToolCallParser):
    """JSON tool calls between ``<tool_call>`` tags (NousResearch Hermes, Qwen2.5, Qwen3)."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"
    call_format = ToolCallFormat("<tool_call>\n", "\n</tool_call>")

    def parse_block(self, body: str, tools: Sequence[Tool] | None) -> list[Call] | None:
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return None
        return [parsed] if (parsed := json_call(call)) else None


def json_call(call: object, arguments_keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """(name, arguments JSON) of a ``{"name": ..., "arguments": {...}}`` object, or None."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    key = next((k for k in arguments_keys if k in call), None)
    arguments = arguments_json(call[key]) if key else "{}"
    return None if arguments is None else (call["name"], arguments)
