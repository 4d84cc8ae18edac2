"""Hermes / Qwen2.5 / Qwen3 / Granite 4.0 tool calls: a JSON object per ``<tool_call>...</tool_call>`` block.

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


class Granite4ToolCallParser(HermesToolCallParser):
    """IBM Granite 4.0 (as vLLM's granite4 parser): Hermes calls, read with special tokens kept, because some
    Granite tokenizers mark ``<tool_call>`` / ``</tool_call>`` special and decoding would drop them."""

    reads_special_tokens = True


def json_call(call: object, arguments_keys: tuple[str, ...] = ("arguments",)) -> Call | None:
    """(name, arguments JSON) of a ``{"name": ..., "arguments": {...}}`` object, or None."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    key = next((k for k in arguments_keys if k in call), None)
    arguments = arguments_json(call[key]) if key else "{}"
    return None if arguments is None else (call["name"], arguments)


def json_call_list(text: str) -> list[Call] | None:
    """The calls of a JSON list of ``{"name": ..., "arguments": ...}`` objects (one object alone counts as a
    list of one); None when `text` is anything else, an empty list, or holds one malformed call."""
    try:
        calls = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        return None
    parsed = [json_call(call) for call in calls]
    return None if None in parsed else parsed  # type: ignore[return-value]
